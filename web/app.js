// kvd's page: a chat playground over /v1/chat/completions (streamed) and a live
// picture of the KV pool from /pool, polled once a second. Plain JavaScript,
// served by kvd from its binary; it talks to this server only.
'use strict';

(() => {
  const $ = (id) => document.getElementById(id);
  const STATES = ['free', 'cached', 'in use', 'pending', 'fenced'];
  const POLL_MS = 1000;
  const WINDOW_S = 300;           // the curves' width: kvd keeps five minutes of samples

  let apiKey = sessionStorage.getItem('kvd-api-key') || '';
  let view = null;                // the last /pool answer

  function headers(json) {
    const h = {};
    if (json) h['Content-Type'] = 'application/json';
    if (apiKey) h.Authorization = 'Bearer ' + apiKey;
    return h;
  }

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function fmtBytes(n) {
    const u = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
    let i = 0;
    while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : String(n)) + ' ' + u[i];
  }

  // ---- colours: a hue per tenant, the state as its shade ------------------------------------------

  function tenantName(t) {
    if (!view || t === 0) return 'no tenant';
    if (t === view.hidden_tenant) return 'another tenant';
    return view.tenants[t - 1] || 'tenant ' + t;
  }

  function tenantHue(t) {
    return (t * 137.508) % 360;
  }

  function cellColour(state, t) {
    if (state === 0) return '#e6e9ee';
    if (state === 4) return '#c0392b';
    if (view && t === view.hidden_tenant) return state === 1 ? '#c4c8ce' : '#8c939c';
    const hue = t === 0 ? 215 : tenantHue(t);
    const sat = t === 0 ? 18 : 65;
    if (state === 1) return `hsl(${hue} ${sat}% 74%)`;     // cached: light
    if (state === 3) return `hsl(${hue} ${sat}% 58%)`;     // pending: between
    return `hsl(${hue} ${sat}% 38%)`;                       // in use: dark
  }

  function drawLegend() {
    const lg = $('legend');
    lg.textContent = '';
    const item = (colour, label) => {
      const s = el('span');
      const sw = el('span', 'swatch');
      sw.style.background = colour;
      s.append(sw, label);
      lg.append(s);
    };
    [0, 1, 3, 2, 4].forEach((st) => item(cellColour(st, 0), STATES[st]));
    const seen = new Set();
    for (const h of view.hosts) for (const r of h.runs) if (r[0] !== 0 && r[1] !== 0) seen.add(r[1]);
    for (const t of [...seen].sort((a, b) => a - b)) item(cellColour(2, t), tenantName(t));
  }

  // ---- the block map: one canvas per host, a cell per block (or group) ----------------------------

  function drawHost(div, h) {
    let canvas = div.querySelector('canvas');
    if (!canvas) {
      div.append(el('div', 'dim host-title'));
      canvas = el('canvas');
      div.append(canvas);
      canvas.addEventListener('mousemove', (ev) => hover(ev, canvas));
    }
    const cells = h.runs.reduce((n, r) => n + r[2], 0);
    const px = Math.max(2, Math.min(14, Math.floor(Math.sqrt((480 * 200) / Math.max(cells, 1)))));
    const cols = Math.max(1, Math.floor(480 / px));
    const rows = Math.max(1, Math.ceil(cells / cols));
    canvas.width = cols * px;
    canvas.height = rows * px;
    const g = canvas.getContext('2d');
    const gap = px >= 5 ? 1 : 0;
    let c = 0;
    const count = [0, 0, 0, 0, 0];
    for (const [state, t, n] of h.runs) {
      g.fillStyle = cellColour(state, t);
      for (let i = 0; i < n; i++, c++) {
        g.fillRect((c % cols) * px, Math.floor(c / cols) * px, px - gap, px - gap);
      }
      count[state] += n * h.cell_blocks;
    }
    canvas.kvd = { h, px, cols };
    const title = div.querySelector('.host-title');
    title.textContent = `${h.name || 'this host'}: ${h.blocks} blocks` +
      (h.cell_blocks > 1 ? ` (a cell per ${h.cell_blocks} blocks)` : '') + ' — ' +
      STATES.map((s, i) => `${count[i]} ${s}`).join(', ');
    // what the tests (and anyone curious) read without decoding the canvas
    div.dataset.free = count[0];
    div.dataset.cached = count[1];
    div.dataset.inUse = count[2];
    div.dataset.pending = count[3];
    div.dataset.fenced = count[4];
  }

  function hover(ev, canvas) {
    const k = canvas.kvd;
    if (!k) return;
    const r = canvas.getBoundingClientRect();
    const x = Math.floor(((ev.clientX - r.left) * canvas.width) / r.width / k.px);
    const y = Math.floor(((ev.clientY - r.top) * canvas.height) / r.height / k.px);
    const cell = y * k.cols + x;
    let c = 0;
    for (const [state, t, n] of k.h.runs) {
      if (cell < c + n) {
        const first = cell * k.h.cell_blocks;
        const last = Math.min(first + k.h.cell_blocks, k.h.blocks) - 1;
        $('cell-info').textContent = (first === last ? `block ${first}` : `blocks ${first}-${last}`) +
          `: ${STATES[state]}` + (state ? `, ${tenantName(t)}` : '');
        return;
      }
      c += n;
    }
  }

  function drawHosts() {
    const box = $('hosts');
    while (box.children.length > view.hosts.length) box.lastChild.remove();
    view.hosts.forEach((h, i) => {
      let div = box.children[i];
      if (!div) { div = el('div', 'host'); box.append(div); }
      drawHost(div, h);
    });
    const t = view.totals;
    $('pool-summary').textContent = `${t.blocks_total} blocks of ${view.block_tokens} tokens, ${view.kv_type}; ` +
      `${t.requests_running} running, ${t.requests_queued} queued`;
  }

  // ---- the prefix trees --------------------------------------------------------------------------------

  function drawPrefixes() {
    const root = $('prefix-tree');
    root.textContent = '';
    const lists = [];
    view.prefixes.forEach((p, i) => {
      const li = el('li');
      li.className = 'prefix';
      li.dataset.blocks = p.blocks;
      li.dataset.sharers = p.sharers;
      li.dataset.hits = p.hits;
      const n = el('span', 'node');
      const sw = el('span', 'swatch');
      sw.style.background = cellColour(p.state === 'in_use' ? 2 : p.state === 'pending' ? 3 : 1, p.tenant);
      n.append(sw);
      n.append(el('span', '', `${p.blocks} blocks` + (p.subtree_blocks > p.blocks ? ` (${p.subtree_blocks})` : '')));
      n.append(el('span', 'dim', p.public ? 'public' : tenantName(p.tenant)));
      n.append(el('span', '', `shared by ${p.sharers}`));
      n.append(el('span', '', `${p.hits} hits`));
      n.append(el('span', 'text', p.text));
      li.append(n);
      const parent = p.parent >= 0 ? lists[p.parent] : null;
      let ul = root;
      if (parent) {
        ul = parent.querySelector(':scope > ul');
        if (!ul) { ul = el('ul'); parent.append(ul); }
      }
      ul.append(li);
      lists[i] = li;
    });
    if (!view.prefixes.length) root.append(el('li', 'dim', 'nothing cached yet'));
  }

  // ---- the curves ----------------------------------------------------------------------------------

  function curve(id, values, fmt) {
    const c = $(id);
    const g = c.getContext('2d');
    g.clearRect(0, 0, c.width, c.height);
    const max = Math.max(...values.filter((v) => v !== null), 0);
    const top = max > 0 ? max * 1.1 : 1;
    g.strokeStyle = '#d9dde3';
    g.beginPath();
    g.moveTo(0, c.height - 0.5);
    g.lineTo(c.width, c.height - 0.5);
    g.stroke();
    g.strokeStyle = '#2a6fdb';
    g.lineWidth = 1.5;
    g.beginPath();
    let pen = false;
    const dx = c.width / (WINDOW_S - 1);
    const off = WINDOW_S - values.length;
    const dots = [];
    values.forEach((v, i) => {
      if (v === null) { pen = false; return; }
      const x = (off + i) * dx;
      const y = c.height - 4 - (v / top) * (c.height - 18);
      if (pen) g.lineTo(x, y); else g.moveTo(x, y);
      const alone = (i === 0 || values[i - 1] === null) && (i === values.length - 1 || values[i + 1] === null);
      if (alone) dots.push([x, y]);       // a second with no neighbour: a dot, not a line
      pen = true;
    });
    g.stroke();
    g.fillStyle = '#2a6fdb';
    for (const [x, y] of dots) g.fillRect(x - 1.5, y - 1.5, 3, 3);
    g.fillStyle = '#6b7480';
    g.font = '11px system-ui, sans-serif';
    const last = [...values].reverse().find((v) => v !== null);
    g.fillText(`max ${fmt(max)}` + (last !== undefined ? `   last ${fmt(last)}` : ''), 4, 12);
  }

  function drawCurves() {
    const s = view.samples;
    curve('curve-hit', s.map((x) => (x.prompt_tokens ? x.cached_prompt_tokens / x.prompt_tokens : null)),
      (v) => (v * 100).toFixed(0) + '%');
    curve('curve-ttft', s.map((x) => (x.first_tokens ? x.ttft_seconds / x.first_tokens : null)),
      (v) => v.toFixed(3) + ' s');
    curve('curve-tps', s.map((x) => x.computed_tokens), (v) => v.toFixed(0));
  }

  // ---- tiers and tenants -----------------------------------------------------------------------------

  function drawTables() {
    const tb = $('tier-table').tBodies[0];
    tb.textContent = '';
    const t = view.totals;
    const row = (cells) => {
      const tr = el('tr');
      cells.forEach((c) => tr.append(el('td', '', String(c))));
      tb.append(tr);
    };
    row(['pool', `${t.blocks_total - t.blocks_free} of ${t.blocks_total} blocks taken`,
      `${t.blocks_cached} cached`, `${t.evictions} evicted`]);
    const h = view.tiers.host;
    row(['host tier', h.max_bytes ? `${fmtBytes(h.bytes)} of ${fmtBytes(h.max_bytes)}` : 'off',
      `${h.blocks} blocks`, `${h.cached_prompt_tokens} tokens served`]);
    const d = view.tiers.disk;
    row(['disk tier', d.max_bytes ? `${fmtBytes(d.bytes)} of ${fmtBytes(d.max_bytes)}` : 'off',
      `${d.blocks} blocks`, `${d.cached_prompt_tokens} tokens served`]);
    const hit = t.prompt_tokens ? ((100 * t.cached_prompt_tokens) / t.prompt_tokens).toFixed(1) + '%' : '-';
    row(['since start', `${t.requests_done} requests`, `${t.prompt_tokens} prompt tokens`, `hit rate ${hit}`]);
    const tt = $('tenant-table').tBodies[0];
    tt.textContent = '';
    for (const r of view.tenant_rows) {
      const tr = el('tr');
      [r.name, r.requests, r.prompt_tokens, r.cached_prompt_tokens, r.blocks_held, r.queued, r.running]
        .forEach((c) => tr.append(el('td', '', String(c))));
      tt.append(tr);
    }
  }

  // ---- polling -----------------------------------------------------------------------------------------

  async function poll() {
    try {
      const res = await fetch('/pool', { headers: headers(false), cache: 'no-store' });
      if (res.status === 401) {
        $('status').textContent = 'the pool needs an API key';
      } else if (!res.ok) {
        $('status').textContent = `pool: ${res.status}`;
      } else {
        view = await res.json();
        $('model').textContent = view.model;
        $('viewer').textContent = view.viewer === 'tenant' ? `tenant ${view.tenant}` : view.viewer;
        drawLegend();
        drawHosts();
        drawPrefixes();
        drawCurves();
        drawTables();
        $('status').textContent = 'live';
        document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
      }
    } catch (e) {
      $('status').textContent = 'kvd does not answer';
    }
    setTimeout(poll, POLL_MS);
  }

  // ---- chat ------------------------------------------------------------------------------------------

  let history = [];
  let controller = null;

  function addMsg(role, text) {
    const m = el('div', 'msg ' + role, text);
    $('chat-log').append(m);
    $('chat-log').scrollTop = $('chat-log').scrollHeight;
    return m;
  }

  function showUsage(u, ms) {
    const box = $('usage');
    if (!u) { box.textContent = 'no usage reported'; return; }
    const cached = (u.prompt_tokens_details && u.prompt_tokens_details.cached_tokens) || 0;
    box.dataset.prompt = u.prompt_tokens;
    box.dataset.cached = cached;
    box.dataset.completion = u.completion_tokens;
    box.textContent = `prompt ${u.prompt_tokens} tokens, ${cached} of them from the cache; ` +
      `${u.completion_tokens} generated` + (ms !== null ? `; first token after ${ms.toFixed(0)} ms` : '');
  }

  async function send(ev) {
    ev.preventDefault();
    const text = $('chat-input').value.trim();
    if (!text || controller) return;
    const system = $('chat-system').value.trim();
    history.push({ role: 'user', content: text });
    addMsg('user', text);
    $('chat-input').value = '';
    const out = addMsg('assistant', '');
    out.classList.add('streaming');
    const messages = (system ? [{ role: 'system', content: system }] : []).concat(history);
    const body = {
      messages, stream: true, stream_options: { include_usage: true },
      max_tokens: Math.max(1, Number($('chat-max').value) || 64),
    };
    controller = new AbortController();
    $('chat-send').disabled = true;
    $('chat-stop').disabled = false;
    const t0 = performance.now();
    let first = null;
    let usage = null;
    let answer = '';
    try {
      const res = await fetch('/v1/chat/completions', {
        method: 'POST', headers: headers(true), body: JSON.stringify(body), signal: controller.signal,
      });
      if (!res.ok) {
        const e = await res.json().catch(() => null);
        throw new Error(e && e.error ? e.error.message : `${res.status} ${res.statusText}`);
      }
      const reader = res.body.getReader();
      const dec = new TextDecoder();
      let buf = '';
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += dec.decode(value, { stream: true });
        let cut;
        while ((cut = buf.indexOf('\n\n')) >= 0) {
          const event = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          for (const line of event.split('\n')) {
            if (!line.startsWith('data:')) continue;
            const data = line.slice(5).trim();
            if (data === '[DONE]') continue;
            const o = JSON.parse(data);
            if (o.usage) usage = o.usage;
            const d = o.choices && o.choices[0] && o.choices[0].delta;
            if (d && d.content) {
              if (first === null) first = performance.now();
              answer += d.content;
              out.textContent = answer;
              out.dataset.chunks = String(Number(out.dataset.chunks || 0) + 1);
            }
          }
        }
      }
      history.push({ role: 'assistant', content: answer });
      showUsage(usage, first !== null ? first - t0 : null);
      out.dataset.done = '1';
    } catch (e) {
      history.pop();
      if (e.name === 'AbortError') {
        out.textContent = answer + ' [stopped]';
      } else {
        out.classList.add('error');
        out.textContent = String(e.message || e);
      }
    } finally {
      out.classList.remove('streaming');
      controller = null;
      $('chat-send').disabled = false;
      $('chat-stop').disabled = true;
    }
  }

  function init() {
    $('api-key').value = apiKey;
    $('api-key').addEventListener('change', () => {
      apiKey = $('api-key').value.trim();
      sessionStorage.setItem('kvd-api-key', apiKey);
    });
    $('chat-form').addEventListener('submit', send);
    $('chat-input').addEventListener('keydown', (ev) => {
      if (ev.key === 'Enter' && !ev.shiftKey) send(ev);
    });
    $('chat-stop').addEventListener('click', () => controller && controller.abort());
    $('chat-new').addEventListener('click', () => {
      history = [];
      $('chat-log').textContent = '';
    });
    poll();
  }

  init();
})();
