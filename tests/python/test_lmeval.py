"""lm-eval (EleutherAI's harness, `local-completions`) against kvd's HTTP API on a small
multiple-choice task shipped here (lmeval/kvd_mc.yaml and its JSONL: 20 questions, no
download).

lm-eval finds kvd's tokenizer through GET /tokenizer_info and POST /tokenize (its "remote"
tokenizer), scores each choice with /v1/completions' echo and logprobs, and takes the
likeliest. The same accuracy is computed here from kvd's echoed log-probabilities directly,
and every choice's log-likelihood is held to kvd-run --score's, the engine's own numbers
from a process of its own (within 1e-4).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import BIN_DIR, MODEL, _stop_checked
from test_http import MODEL_ID, HttpDaemon

TASK_DIR = Path(__file__).resolve().parent / "lmeval"
DOCS = [json.loads(line) for line in (TASK_DIR / "kvd_mc.jsonl").read_text().splitlines() if line.strip()]

# lm-eval in a process of its own (its logging, its environment), from the task's folder (the
# YAML names its data file relative to it); it prints the results and the samples as JSON
RUN_LMEVAL = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
from lm_eval.utils import setup_logging
setup_logging("INFO")
base_url, model, extra, out = sys.argv[1:5]
args = {"model": model, "base_url": base_url, "max_retries": 1, "timeout": 120}
args.update(json.loads(extra))
r = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=["kvd_mc"],
                            task_manager=TaskManager(include_path="."), log_samples=True)
with open(out, "w") as f:
    json.dump({"results": r["results"], "samples": r["samples"], "config": r["config"]}, f, default=str)
"""


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    h = HttpDaemon(tmp_path_factory.mktemp("kvd-lmeval"), "--kv-memory", "64MiB", "-w", "1")
    h.d.measure_patience()
    yield h
    _stop_checked(h.d)


def context_of(doc: dict[str, Any]) -> str:
    return f"Question: {doc['question']}\nAnswer:"


def run_lmeval(api: HttpDaemon, tmp: Path, extra: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ, HF_HOME=str(tmp / "hf"), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    out = tmp / "lmeval.json"
    p = subprocess.run([sys.executable, "-c", RUN_LMEVAL, api.base + "/v1/completions", MODEL_ID,
                        json.dumps(extra), str(out)], cwd=TASK_DIR, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    result: dict[str, Any] = json.loads(out.read_text())
    result["log"] = p.stderr
    return result


def lmeval_scores(result: dict[str, Any]) -> list[list[float]]:
    """Each question's choices' log-likelihoods as lm-eval scored them, in the data's order."""
    samples = sorted(result["samples"]["kvd_mc"], key=lambda s: s["doc_id"])
    assert [s["doc"]["question"] for s in samples] == [d["question"] for d in DOCS]
    return [[float(r[0]) for r in s["filtered_resps"]] for s in samples]


def kvd_scores(api: HttpDaemon) -> list[list[tuple[float, int]]]:
    """Each choice's log-likelihood from kvd's echo: the text of context and choice scored
    (max_tokens 0), the tokens that start at or past the context's end summed."""
    out = []
    for doc in DOCS:
        ctx = context_of(doc)
        prompts = [ctx + " " + c for c in doc["choices"]]
        s, _, r = api.post("/v1/completions", {"model": MODEL_ID, "prompt": prompts, "echo": True, "logprobs": 0,
                                               "max_tokens": 0})
        assert s == 200, r
        row = []
        for ch in sorted(r["choices"], key=lambda c: c["index"]):
            lp = ch["logprobs"]
            assert ch["text"] == prompts[ch["index"]]
            # the context's tokens end where the choice starts: the split is the same as lm-eval's
            assert len(ctx) in lp["text_offset"]
            start = lp["text_offset"].index(len(ctx))
            row.append((sum(lp["token_logprobs"][start:]), len(lp["tokens"]) - start))
        out.append(row)
    return out


def kvd_run_scores() -> list[list[tuple[float, int]]]:
    """The same from kvd-run --score, every pair in one run."""
    args = [str(BIN_DIR / "kvd-run"), "-m", str(MODEL)]
    for doc in DOCS:
        for c in doc["choices"]:
            args += ["--score", context_of(doc), "--continuation", " " + c]
    p = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    lines = [json.loads(line) for line in p.stdout.splitlines()]
    assert len(lines) == sum(len(d["choices"]) for d in DOCS)
    for line in lines:
        assert abs(sum(line["logprobs"]) - line["logprob"]) < 1e-6
    it = iter(lines)
    return [[(x["logprob"], len(x["tokens"])) for x in (next(it) for _ in d["choices"])] for d in DOCS]


def accuracy(scores: list[list[float]]) -> float:
    right = sum(max(range(len(row)), key=lambda i: row[i]) == d["answer"] for row, d in zip(scores, DOCS))
    return float(right) / len(DOCS)


@pytest.fixture(scope="module")
def references(api: HttpDaemon) -> tuple[list[list[tuple[float, int]]], list[list[tuple[float, int]]]]:
    return kvd_scores(api), kvd_run_scores()


def test_kvd_echo_equals_kvd_run(references: Any) -> None:
    direct, engine = references
    for d_row, e_row in zip(direct, engine):
        for (d, dn), (e, en) in zip(d_row, e_row):
            assert dn == en and abs(d - e) < 1e-4, (d, e)
    # the task tells the choices apart (no two alike), so an accuracy means something
    for row in direct:
        assert len({round(x, 3) for x, _ in row}) == len(row)


@pytest.mark.parametrize("tokenized", [True, False], ids=["token-ids", "text"])
def test_lmeval_accuracy(api: HttpDaemon, tmp_path: Path, references: Any, tokenized: bool) -> None:
    # token ids: lm-eval tokenizes through /tokenize and sends the ids; text: it sends the
    # text and finds the context's end with the same tokenizer
    result = run_lmeval(api, tmp_path, {"tokenized_requests": tokenized})
    assert "Using remote tokenizer" in result["log"]
    direct, engine = references
    scores = lmeval_scores(result)
    for l_row, d_row, e_row in zip(scores, direct, engine):
        for got, (d, _), (e, _) in zip(l_row, d_row, e_row):
            assert abs(got - d) < 1e-4 and abs(got - e) < 1e-4, (got, d, e)
    acc = result["results"]["kvd_mc"]["acc,none"]
    assert acc == accuracy(scores) == accuracy([[x for x, _ in row] for row in direct])
    assert acc == accuracy([[x for x, _ in row] for row in engine])
    assert result["results"]["kvd_mc"]["sample_len"] == len(DOCS) == 20
