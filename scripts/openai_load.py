#!/usr/bin/env python3
"""The same requests against any OpenAI-compatible server: throughput and
per-token latency at a fixed number of clients.

Each of C clients sends its share of N requests to `/v1/completions` one
after another (a closed loop), streaming, with the same prompts (request i's
prompt starts with its index, so no two share a cached prefix), `max_tokens`
and greedy decoding. The server's stop tokens end a request early (not
every server has `ignore_eos`); throughput counts the tokens each answer
streamed, and the table says how many that was.

Prints one JSON line per level; a level with a failed request (an HTTP
error, or TIMEOUT_S seconds of silence) starts no new request and ends the
run. Lines:
  {"server", "clients", "requests", "tokens", "wall_s", "tok_s",
   "ttft_p50_ms", "itl_p50_ms", "itl_p99_ms", "errors"}

Only the standard library: it runs wherever python3 does.
"""

import argparse
import http.client
import json
import os
import sys
import threading
import time
import urllib.parse

WORDS = (
    "the river ran past the old mill where the miller kept his accounts in a "
    "ledger bound in green leather and every evening he wrote down what the "
    "day had brought and what it had taken away"
).split()


def prompt_text(i, words):
    """Request i's prompt: its index, then `words` words of a fixed text."""
    body = " ".join(WORDS[k % len(WORDS)] for k in range(words))
    return f"Story {i}: {body}"


TIMEOUT_S = [60.0]


def one_request(url, model, prompt, max_tokens):
    """Streams one completion; returns (ttft_s, [inter-token gaps s], tokens).
    Raises when the server sends nothing for TIMEOUT_S seconds."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=TIMEOUT_S[0])
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    if model:
        body["model"] = model
    t0 = time.perf_counter()
    conn.request(
        "POST",
        "/v1/completions",
        body=json.dumps(body),
        headers={"content-type": "application/json"},
    )
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    stamps = []
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        choices = chunk.get("choices") or []
        if choices and choices[0].get("text"):
            stamps.append(time.perf_counter())
    conn.close()
    if not stamps:
        return None, [], 0
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return stamps[0] - t0, gaps, len(stamps)


def level(url, model, clients, requests, words, max_tokens):
    ttfts, gaps, tokens, errors = [], [], [0], []
    lock = threading.Lock()
    next_id = [0]

    def client():
        while True:
            with lock:
                i = next_id[0]
                # After a failure no new request starts: a server that
                # stopped answering costs one timeout, not one per request.
                if i >= requests or errors:
                    return
                next_id[0] += 1
            try:
                ttft, g, n = one_request(url, model, prompt_text(i, words), max_tokens)
            except Exception as e:  # noqa: BLE001 - reported, not raised
                with lock:
                    errors.append(f"request {i}: {type(e).__name__}: {str(e)[:200]}")
                continue
            with lock:
                if ttft is not None:
                    ttfts.append(ttft)
                gaps.extend(g)
                tokens[0] += n

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0

    def q(v, p):
        if not v:
            return None
        v = sorted(v)
        return 1e3 * v[min(len(v) - 1, int(p * len(v)))]

    return {
        "clients": clients,
        "requests": requests,
        "tokens": tokens[0],
        "wall_s": round(wall, 3),
        "tok_s": round(tokens[0] / wall, 1),
        "ttft_p50_ms": q(ttfts, 0.5),
        "itl_p50_ms": q(gaps, 0.5),
        "itl_p99_ms": q(gaps, 0.99),
        "errors": errors[:3] + ([f"... {len(errors)} in all"] if len(errors) > 3 else []),
    }


def alive(pid):
    """False once process `pid` (None: not watched) has exited."""
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of someone else's shell still answers kill(0).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def wait_ready(url, seconds, pid=None):
    """The first model id `/v1/models` lists, once it answers; None on
    timeout or when the server's process `pid` exits first."""
    u = urllib.parse.urlparse(url)
    deadline = time.time() + seconds
    while time.time() < deadline and alive(pid):
        try:
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=5)
            conn.request("GET", "/v1/models")
            resp = conn.getresponse()
            if resp.status == 200:
                data = json.loads(resp.read()).get("data") or [{}]
                return data[0].get("id", "")
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="http://host:port")
    ap.add_argument("--server", required=True, help="a label for the output")
    ap.add_argument("--model", default=None, help="the request's model field (default: the first /v1/models lists)")
    ap.add_argument("--clients", default="1,32", help="levels, comma-separated")
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--prompt-words", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--wait", type=float, default=180, help="seconds to wait for /v1/models")
    ap.add_argument("--pid", type=int, default=None, help="stop waiting when this process exits")
    ap.add_argument("--request-timeout", type=float, default=60, help="seconds of silence that fail a request")
    a = ap.parse_args()
    TIMEOUT_S[0] = a.request_timeout
    listed = wait_ready(a.url, a.wait, a.pid)
    if listed is None:
        why = "exited before it answered" if not alive(a.pid) else "not ready"
        print(json.dumps({"server": a.server, "error": why}))
        return 1
    if a.model is None:
        a.model = listed or None
    # One untimed request: first-use costs stay out of the table.
    level(a.url, a.model, 1, 1, a.prompt_words, 8)
    for c in [int(x) for x in a.clients.split(",")]:
        n = max(a.min_requests, c * a.requests_per_client)
        r = level(a.url, a.model, c, n, a.prompt_words, a.max_tokens)
        r["server"] = a.server
        print(json.dumps(r), flush=True)
        if r["errors"]:
            print(json.dumps({"server": a.server, "error": f"stopped after {c} clients: a request failed"}))
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
