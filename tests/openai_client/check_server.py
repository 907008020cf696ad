"""Drives a running `serve` example with the official `openai` package.

    python3 check_server.py BASE_URL      # e.g. http://127.0.0.1:8123/v1

Checks both endpoints whole and streamed (greedy answers equal either way,
usage in the last chunk when asked for), vLLM's `return_token_ids`, the
model list, and that refusals arrive as the client's typed errors. Exits
non-zero on the first failure.
"""

import sys

import openai
from openai import OpenAI

MAX_TOKENS = 12


def check(cond, what):
    if not cond:
        sys.exit(f"openai client check failed: {what}")
    print(f"ok: {what}")


def main(base_url):
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)

    models = client.models.list().data
    check(len(models) == 1, f"one served model ({[m.id for m in models]})")
    model = models[0].id

    # Completions, whole then streamed.
    prompt = "The capital of France is"
    whole = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
    )
    text = whole.choices[0].text
    check(len(text) > 0, f"completion text {text!r}")
    check(whole.usage.completion_tokens <= MAX_TOKENS, f"usage {whole.usage}")
    check(whole.choices[0].finish_reason in ("stop", "length"), "finish reason")
    chunks = list(
        client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    check(streamed == text, f"streamed completion equals the whole one ({streamed!r})")
    check(chunks[-1].usage is not None, "usage in the last chunk")
    check(
        chunks[-1].usage.completion_tokens == whole.usage.completion_tokens,
        "streamed usage equals the whole answer's",
    )

    # Token ids as the prompt, and vLLM's return_token_ids.
    ids = client.completions.create(
        model=model,
        prompt=[1, 2, 3, 4, 5],
        max_tokens=4,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    got = ids.choices[0].model_extra.get("token_ids")
    check(isinstance(got, list) and len(got) == 4, f"return_token_ids gives 4 ids ({got})")

    # Chat, whole then streamed.
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    answer = chat.choices[0].message.content
    check(chat.choices[0].message.role == "assistant", "assistant role")
    check("Paris" in answer, f"the chat answer names Paris ({answer!r})")
    parts = []
    for c in client.chat.completions.create(
        model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
    ):
        if c.choices and c.choices[0].delta.content:
            parts.append(c.choices[0].delta.content)
    check("".join(parts) == answer, "streamed chat equals the whole one")

    # Refusals are the client's typed errors.
    try:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
        check(False, "an unknown model is refused")
    except openai.NotFoundError as e:
        check(e.status_code == 404, f"unknown model: 404 ({e.message})")
    try:
        client.completions.create(model=model, prompt="x", max_tokens=1, n=2)
        check(False, "n = 2 is refused")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and "n" in str(e.body), f"n = 2: 400 ({e.message})")
    try:
        client.chat.completions.create(model=model, messages=[], max_tokens=1)
        check(False, "no messages is refused")
    except openai.BadRequestError as e:
        check(e.status_code == 400, f"no messages: 400 ({e.message})")
    print("openai client: all checks passed")


if __name__ == "__main__":
    main(sys.argv[1])
