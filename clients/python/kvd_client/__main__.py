"""python -m kvd_client: generate from the command line, as ``kvcli generate``
does (same options, same ``--json`` fields), streaming to stdout.

Exit status: 0 done, 1 an error from kvd or the connection (one line on
stderr), 2 a usage error, 130 cancelled with Ctrl-C (what came is printed and
the request is cancelled at kvd; a second Ctrl-C quits at once).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Callable, Sequence
from types import FrameType
from typing import BinaryIO, NoReturn

from . import errors
from ._wire import DEFAULT_TIMEOUT, default_endpoint
from .client import Client
from .results import ChatMessage, Result

PROG = "python -m kvd_client"
MAX_STOPS = 16


def _int_range(name: str, lo: int, hi: int) -> Callable[[str], int]:
    def parse(s: str) -> int:
        try:
            v = int(s, 10)
        except ValueError:
            v = lo - 1
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{name} must be an integer in [{lo}, {hi}], got '{s}'")
        return v

    return parse


def _nonneg_float(name: str) -> Callable[[str], float]:
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            v = -1.0
        if not (v >= 0 and v != float("inf")):
            raise argparse.ArgumentTypeError(f"{name} must be a number >= 0, got '{s}'")
        return v

    return parse


def _ids(s: str) -> list[int]:
    out: list[int] = []
    for part in s.replace(" ", ",").split(","):
        if not part:
            continue
        try:
            v = int(part, 10)
        except ValueError:
            v = -1
        if not 0 <= v < 1 << 31:
            raise argparse.ArgumentTypeError(
                f"--prompt-ids wants comma-separated ids >= 0, got '{s}'"
            )
        out.append(v)
    if not out:
        raise argparse.ArgumentTypeError("--prompt-ids holds no ids")
    return out


def make_parser() -> argparse.ArgumentParser:
    """The command line's parser (kvcli generate's options)."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Generate a continuation of PROMPT with kvd, streamed to stdout "
        "(the Python twin of `kvcli generate`).",
    )
    p.add_argument("prompt", nargs="?", metavar="PROMPT", help='the prompt ("-": read stdin)')
    p.add_argument(
        "-e", "--endpoint",
        help="kvd's endpoint (default $KVD_ENDPOINT, else ipc://$XDG_RUNTIME_DIR/kvd/kvd.sock "
        "or ipc:///tmp/kvd-UID/kvd.sock)",
    )
    p.add_argument(
        "--timeout", type=_int_range("--timeout", 1, 24 * 3600 * 1000), metavar="MS",
        help=f"longest wait for one message from kvd (default {int(DEFAULT_TIMEOUT * 1000)})",
    )
    p.add_argument("--chat", action="store_true",
                   help="send PROMPT as a user message, through the chat template")
    p.add_argument("--system", metavar="TEXT", help="a system message first (with --chat)")
    p.add_argument("--system-file", metavar="FILE", help="the same, read from FILE")
    p.add_argument("--prompt-ids", type=_ids, metavar="IDS",
                   help="token ids (comma-separated) instead of PROMPT")
    p.add_argument("-n", dest="max_tokens", type=_int_range("-n", 1, 1 << 20), metavar="N",
                   help="tokens to generate at most (default: kvd's, 256)")
    p.add_argument("--temp", type=_nonneg_float("--temp"), metavar="T",
                   help="temperature (0: greedy)")
    p.add_argument("--top-k", type=_int_range("--top-k", 0, 1 << 20), metavar="K")
    p.add_argument("--top-p", type=_nonneg_float("--top-p"), metavar="P")
    p.add_argument("--min-p", type=_nonneg_float("--min-p"), metavar="P")
    p.add_argument("--repeat-penalty", type=_nonneg_float("--repeat-penalty"), metavar="R")
    p.add_argument("--seed", type=_int_range("--seed", 0, (1 << 63) - 1), metavar="S",
                   help="sampling seed (default random)")
    p.add_argument("--stop", action="append", default=[], metavar="STR",
                   help=f"stop at STR (repeatable, up to {MAX_STOPS})")
    p.add_argument("--namespace", metavar="NS",
                   help="prefix-cache namespace (a convenience, not isolation)")
    p.add_argument("--no-cache", action="store_true",
                   help="neither use nor fill the prefix cache")
    p.add_argument("--deadline", type=_int_range("--deadline", 1, 24 * 3600 * 1000),
                   metavar="MS", help="give up after MS milliseconds at kvd")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate past end-of-generation tokens")
    p.add_argument("--no-stream", action="store_true",
                   help="print the text once it is complete")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: text, tokens, finish_reason, usage and timings "
                   "(kvcli's fields)")
    return p


def _die(msg: str, status: int = 1) -> NoReturn:
    sys.stderr.write(f"{PROG}: {msg}\n")
    sys.stderr.flush()
    sys.exit(status)


def _write(out: BinaryIO, text: str) -> None:
    out.write(text.encode("utf-8", "surrogateescape"))
    out.flush()


def _print_json(out: BinaryIO, r: Result) -> None:
    _write(out, json.dumps(r.to_dict(), ensure_ascii=False, separators=(",", ":")) + "\n")


def _describe(e: errors.KvdError) -> str:
    if e.code is None:
        return str(e)
    return f"{type(e).__name__}: {e}"


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    parser = make_parser()
    a = parser.parse_args(argv)
    if a.prompt_ids is not None:
        if a.prompt is not None:
            parser.error("--prompt-ids and PROMPT exclude each other")
        if a.chat:
            parser.error("--prompt-ids and --chat exclude each other")
    elif a.prompt is None:
        parser.error("generate needs a PROMPT (or --prompt-ids)")
    if len(a.stop) > MAX_STOPS:
        parser.error(f"at most {MAX_STOPS} --stop strings")
    if any(s == "" for s in a.stop):
        parser.error("--stop needs a non-empty string")
    system: str | None = a.system
    if a.system_file is not None:
        try:
            with open(a.system_file, encoding="utf-8", errors="surrogateescape") as f:
                system = f.read()
        except OSError as e:
            _die(f"cannot open {a.system_file}: {e.strerror}")
    if system is not None and not a.chat:
        parser.error("--system and --system-file need --chat")
    prompt: str | None = a.prompt
    if prompt == "-":
        prompt = sys.stdin.read()

    text: str | None = None
    messages: list[ChatMessage] | None = None
    if a.prompt_ids is None and a.chat:
        messages = [ChatMessage("system", system)] if system is not None else []
        messages.append(ChatMessage("user", prompt or ""))
    elif a.prompt_ids is None:
        text = prompt

    endpoint = a.endpoint if a.endpoint is not None else default_endpoint()
    timeout = a.timeout / 1000 if a.timeout is not None else DEFAULT_TIMEOUT
    out = sys.stdout.buffer
    try:
        client = Client(endpoint, timeout=timeout)
    except ValueError as e:
        _die(str(e))

    # first Ctrl-C: cancel at the next message from kvd; second: quit now
    interrupted = False

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        nonlocal interrupted
        if interrupted:
            os._exit(130)
        interrupted = True

    signal.signal(signal.SIGINT, on_sigint)
    streaming = not a.json and not a.no_stream
    printed = False
    with client:
        s = client.stream(
            text, messages=messages, token_ids=a.prompt_ids, max_tokens=a.max_tokens,
            temperature=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
            repeat_penalty=a.repeat_penalty, seed=a.seed, stop=a.stop or None,
            namespace=a.namespace, deadline_ms=a.deadline, ignore_eos=a.ignore_eos,
            no_cache=a.no_cache,
        )
        try:
            with s:
                for chunk in s:
                    if streaming and chunk.text:
                        _write(out, chunk.text)
                        printed = True
                    if interrupted:
                        break   # leaving the block cancels the request at kvd
        except errors.KvdError as e:
            if printed:
                _write(out, "\n")
            _die(_describe(e))
        r = s.result
        if a.json:
            if r is not None:
                _print_json(out, r)
        elif streaming:
            _write(out, "\n")
        elif r is not None:
            _write(out, r.text + "\n")
        if interrupted:
            return 130
        if r is None:  # pragma: no cover - a stream ends with a result or an error
            _die("kvd ended the request without a result")
    return 0


if __name__ == "__main__":
    sys.exit(main())
