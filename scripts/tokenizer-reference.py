#!/usr/bin/env python3
"""Reference token ids for the GGUF tokenizers, from independent implementations.

Writes tests/fixtures/tokenizer_reference.json: the strings of STRINGS and,
for each GGUF vocabulary, the ids an implementation that shares no code with
the crate gives them:

* GPT-2 byte-level BPE (`tokenizer.ggml.model = gpt2`, SmolLM2-135M-Instruct):
  OpenAI's GPT-2 `encoder.py` algorithm (bytes-to-unicode table, merge
  ranks), written out below in plain Python, behind the pre-tokenizer regexes
  llama.cpp uses for the file's `tokenizer.ggml.pre`.
* SentencePiece (`tokenizer.ggml.model = llama`, Gemma 3 270M): Google's
  `sentencepiece` library, given a model proto rebuilt from the GGUF
  vocabulary (pieces, scores, types; user-defined pieces get back the `▁` of
  their spaces, which the GGUF converter wrote as ' ').

It also records, for each `tokenizer.ggml.pre` the crate supports
(`default`, `smollm`, `llama-bpe`), the byte-level pieces its regexes
split each string into.

Control tokens written in the text (`<|im_start|>`, `<start_of_turn>`, ...)
become their ids, as in Hugging Face `tokenizers` and llama.cpp with special
parsing: the text is split on them (longest match first) and the pieces in
between are encoded alone. No BOS/EOS is added.

Reproduce (the venv lives outside the repository):

    python3 -m venv /tmp/tokvenv
    /tmp/tokvenv/bin/pip install gguf==0.19.0 sentencepiece==0.2.3 \
        protobuf==7.36.2 regex==2026.11.19
    /tmp/tokvenv/bin/python scripts/tokenizer-reference.py \
        --gpt2 "$(scripts/fetch-smollm2.sh)" \
        --llama ~/.cache/candle-paged-attention/gemma-3-270m-q4_k_m.gguf
"""

import argparse
import hashlib
import json
import os
import sys

import gguf
import regex

STRINGS = [
    "Hello world",
    "Hello, world! How are you?",
    " leading space",
    "trailing space ",
    "two  spaces and   three",
    "    four leading spaces",
    "tab\tseparated\tvalues",
    "line one\nline two\n\nline four",
    "\n\n\n",
    "mixed \t \n whitespace \r\n end",
    "1234567890",
    "3.14159 and 2,718 and -42",
    "The year 2024 had 366 days.",
    "0x1F4A9 1e-10 007",
    "def add(a, b):\n    return a + b\n",
    "for (int i = 0; i < n; ++i) { sum += x[i]; }",
    "fn main() { println!(\"{}\", 1 + 1); }",
    "<div class=\"x\">&amp;</div>",
    "SELECT * FROM users WHERE id = 7;",
    "café naïve résumé façade",
    "Ångström Øre Ærø",
    "Straße über Größe",
    "Ελληνικά και русский язык",
    "中文分词测试",
    "日本語のテキストです。",
    "한국어 문장입니다",
    "emoji 😀 👍🏽 🇫🇷 ❤️",
    "👨‍👩‍👧‍👦 family",
    "math: ∑ x² ≤ ∞, α β γ",
    "It's, you're, we'll, they'd, I'm",
    "URL https://example.com/a?b=c&d=e#f",
    "email: someone@example.org",
    "ALL CAPS SHOUTING",
    "CamelCaseIdentifierName snake_case_name",
    "!!!???...,,,;;;",
    "a" * 40,
    "<|im_start|>user\nHi<|im_end|>\n",
    "<|im_start|>assistant\nSure.<|im_end|>",
    "<|endoftext|>after end",
    "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after bos",
    "not <|im_start a marker|> and <start_of_turn without end",
    "user text with <|im_end|> inside",
    "quotes \"double\" and 'single' and `back`",
    "   ",
    "x",
    "Zürich’s “smart” quotes — dashes – and … ellipsis",
    "\u00a0non-breaking\u00a0space",
    "ḁ̷̈ combining marks e\u0301",
]

TYPE_NORMAL, TYPE_UNKNOWN, TYPE_CONTROL, TYPE_USER, TYPE_UNUSED, TYPE_BYTE = 1, 2, 3, 4, 5, 6


def field(reader, key):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def split_specials(text, specials):
    """Splits `text` on the control tokens `specials` (longest first):
    yields (is_special, piece)."""
    if not specials:
        yield False, text
        return
    pattern = "|".join(regex.escape(s) for s in sorted(specials, key=len, reverse=True))
    pos = 0
    for m in regex.finditer(pattern, text):
        if m.start() > pos:
            yield False, text[pos : m.start()]
        yield True, m.group(0)
        pos = m.end()
    if pos < len(text):
        yield False, text[pos:]


# ------------------------------------------------------------- GPT-2 BPE

def bytes_to_unicode():
    """OpenAI GPT-2's reversible byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


GPT2_RE = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# llama.cpp's regexes per tokenizer.ggml.pre, applied one after the other.
PRE_REGEXES = {
    "smollm": [r"\p{N}", GPT2_RE],
    "gpt2": [GPT2_RE],
    "default": [GPT2_RE],
    "llama-bpe": [
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ],
}


def regex_split(pieces, pattern):
    """Splits each piece into the regex's matches and the text between them."""
    out = []
    for p in pieces:
        pos = 0
        for m in regex.finditer(pattern, p):
            if m.start() > pos:
                out.append(p[pos : m.start()])
            out.append(m.group(0))
            pos = m.end()
        if pos < len(p):
            out.append(p[pos:])
    return out


class Gpt2Bpe:
    def __init__(self, reader):
        self.tokens = field(reader, "tokenizer.ggml.tokens")
        types = field(reader, "tokenizer.ggml.token_type")
        merges = field(reader, "tokenizer.ggml.merges")
        self.pre = field(reader, "tokenizer.ggml.pre") or "default"
        self.regexes = PRE_REGEXES[self.pre]
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
        self.specials = [t for t, ty in zip(self.tokens, types) if ty == TYPE_CONTROL]
        self.byte_enc = bytes_to_unicode()

    def decode(self, ids):
        dec = {c: b for b, c in self.byte_enc.items()}
        return b"".join(bytes(dec[c] for c in self.tokens[i]) for i in ids).decode("utf-8")

    def bpe(self, word):
        """OpenAI's loop: merge every occurrence of the lowest-ranked pair."""
        parts = list(word)
        while len(parts) > 1:
            pair = min(zip(parts, parts[1:]), key=lambda p: self.ranks.get(p, float("inf")))
            if pair not in self.ranks:
                break
            merged, i = [], 0
            while i < len(parts):
                if i < len(parts) - 1 and (parts[i], parts[i + 1]) == pair:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return parts

    def encode(self, text):
        ids = []
        for special, piece in split_specials(text, self.specials):
            if special:
                ids.append(self.ids[piece])
                continue
            words = [piece]
            for pattern in self.regexes:
                words = regex_split(words, pattern)
            for w in words:
                mapped = "".join(self.byte_enc[b] for b in w.encode("utf-8"))
                ids.extend(self.ids[p] for p in self.bpe(mapped))
        return ids


# --------------------------------------------------------- SentencePiece

class SentencePiece:
    def __init__(self, reader):
        import sentencepiece as spm
        from sentencepiece import sentencepiece_model_pb2 as pb

        tokens = field(reader, "tokenizer.ggml.tokens")
        scores = field(reader, "tokenizer.ggml.scores")
        types = field(reader, "tokenizer.ggml.token_type")
        add_space = field(reader, "tokenizer.ggml.add_space_prefix")
        proto = pb.ModelProto()
        proto.trainer_spec.model_type = pb.TrainerSpec.BPE
        proto.trainer_spec.byte_fallback = True
        proto.trainer_spec.unk_id = field(reader, "tokenizer.ggml.unknown_token_id")
        proto.trainer_spec.bos_id = -1
        proto.trainer_spec.eos_id = -1
        proto.trainer_spec.pad_id = -1
        proto.normalizer_spec.name = "identity"
        proto.normalizer_spec.add_dummy_prefix = bool(add_space) if add_space is not None else True
        proto.normalizer_spec.remove_extra_whitespaces = False
        proto.normalizer_spec.escape_whitespaces = True
        sp_type = {
            TYPE_NORMAL: pb.ModelProto.SentencePiece.NORMAL,
            TYPE_UNKNOWN: pb.ModelProto.SentencePiece.UNKNOWN,
            TYPE_CONTROL: pb.ModelProto.SentencePiece.CONTROL,
            TYPE_USER: pb.ModelProto.SentencePiece.USER_DEFINED,
            TYPE_UNUSED: pb.ModelProto.SentencePiece.UNUSED,
            TYPE_BYTE: pb.ModelProto.SentencePiece.BYTE,
        }
        self.specials = []
        self.tokens = tokens
        self.ids = {}
        for i, (t, s, ty) in enumerate(zip(tokens, scores, types)):
            piece = proto.pieces.add()
            # The GGUF converter wrote the spaces of user-defined pieces as
            # ' '; SentencePiece matches them on the escaped text.
            piece.piece = t.replace(" ", "\u2581") if ty == TYPE_USER else t
            piece.score = s
            piece.type = sp_type[ty]
            self.ids[t] = i
            if ty == TYPE_CONTROL:
                self.specials.append(t)
        self.sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())

    def encode(self, text):
        ids = []
        for special, piece in split_specials(text, self.specials):
            if special:
                ids.append(self.ids[piece])
            else:
                ids.extend(self.sp.encode(piece))
        return ids

    def decode(self, ids):
        # Control pieces decode to nothing in SentencePiece: put their text back.
        out, run = [], []
        for i in ids:
            if self.tokens[i] in self.specials:
                out.append(self.sp.decode(run))
                out.append(self.tokens[i])
                run = []
            else:
                run.append(i)
        out.append(self.sp.decode(run))
        return "".join(out)


def pre_tokenizer_pieces():
    """The byte-level pieces each supported `tokenizer.ggml.pre` splits
    STRINGS into (no vocabulary involved)."""
    enc = bytes_to_unicode()
    out = {}
    for pre in ("default", "smollm", "llama-bpe"):
        rows = []
        for s in STRINGS:
            words = [s]
            for pattern in PRE_REGEXES[pre]:
                words = regex_split(words, pattern)
            rows.append(["".join(enc[b] for b in w.encode("utf-8")) for w in words])
        out[pre] = rows
    return out


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def vocabulary(path, kind):
    reader = gguf.GGUFReader(path)
    model = field(reader, "tokenizer.ggml.model")
    if model != kind:
        sys.exit(f"{path}: tokenizer.ggml.model is {model}, expected {kind}")
    enc = Gpt2Bpe(reader) if kind == "gpt2" else SentencePiece(reader)
    ids = [enc.encode(s) for s in STRINGS]
    for s, i in zip(STRINGS, ids):
        if enc.decode(i) != s:
            sys.exit(f"{path}: {s!r} does not round-trip: {enc.decode(i)!r}")
    return {
        "file": os.path.basename(path),
        "sha256": sha256(path),
        "pre": field(reader, "tokenizer.ggml.pre"),
        "reference": "openai gpt-2 bpe (python)" if kind == "gpt2" else "sentencepiece",
        "ids": ids,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpt2", required=True, help="a GGUF with tokenizer.ggml.model = gpt2 (SmolLM2)")
    ap.add_argument("--llama", required=True, help="a GGUF with tokenizer.ggml.model = llama (Gemma 3)")
    ap.add_argument("--out", default="tests/fixtures/tokenizer_reference.json")
    args = ap.parse_args()
    out = {
        "generator": "scripts/tokenizer-reference.py",
        "strings": STRINGS,
        "gpt2": vocabulary(args.gpt2, "gpt2"),
        "llama": vocabulary(args.llama, "llama"),
        "pre_tokenizers": pre_tokenizer_pieces(),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    for kind in ("gpt2", "llama"):
        v = out[kind]
        print(f"{kind}: {len(v['ids'])} strings, {sum(map(len, v['ids']))} ids", file=sys.stderr)


if __name__ == "__main__":
    main()
