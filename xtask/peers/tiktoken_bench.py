"""Counting throughput of Python tiktoken on a corpus file, for `cargo xtask bench token`.

Usage: python tiktoken_bench.py --bpe O200K_BASE_TIKTOKEN_FILE --corpus FILE [--runs N]
       python tiktoken_bench.py --bpe O200K_BASE_TIKTOKEN_FILE --load

tiktoken downloads its BPE files on first use, and the benchmark must run offline. So
the encoding is built from the o200k_base.tiktoken file that tiktoken-rs ships in its
crate sources (the xtask finds it with `cargo metadata`): tiktoken's own
`openai_public.o200k_base` definition supplies the split pattern and special tokens,
and its loader checks the file against the SHA-256 tiktoken expects, so this is the
stock encoding, byte for byte.

Prints one JSON object: tokens, median MB/s, and the tiktoken version. With --load,
only the milliseconds building the encoding took (reading the file, its hash check
and tiktoken's encoder: what a process pays before its first count), once.
"""

import argparse
import json
import statistics
import time

import tiktoken
import tiktoken.load
import tiktoken_ext.openai_public as openai_public


def o200k_base(bpe_path):
    real_loader = tiktoken.load.load_tiktoken_bpe

    def local_loader(_url, expected_hash=None):
        # Same file, same hash check; only the location differs.
        return real_loader(bpe_path, expected_hash=expected_hash)

    openai_public.load_tiktoken_bpe = local_loader
    try:
        spec = openai_public.o200k_base()
    finally:
        openai_public.load_tiktoken_bpe = real_loader
    return tiktoken.Encoding(
        name=spec["name"],
        pat_str=spec["pat_str"],
        mergeable_ranks=spec["mergeable_ranks"],
        special_tokens=spec["special_tokens"],
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bpe", required=True)
    parser.add_argument("--corpus")
    parser.add_argument("--load", action="store_true")
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()

    start = time.perf_counter()
    enc = o200k_base(args.bpe)
    enc.encode_ordinary("hello")
    load_ms = (time.perf_counter() - start) * 1e3
    if args.load:
        print(json.dumps({"load_ms": load_ms}))
        return
    if args.corpus is None:
        parser.error("--corpus is required without --load")
    with open(args.corpus, encoding="utf-8") as f:
        text = f.read()
    megabytes = len(text.encode("utf-8")) / 1e6

    tokens = len(enc.encode_ordinary(text))  # warm-up
    rates = []
    for _ in range(args.runs):
        start = time.perf_counter()
        n = len(enc.encode_ordinary(text))
        rates.append(megabytes / (time.perf_counter() - start))
        assert n == tokens, "counts differ between runs"

    print(
        json.dumps(
            {
                "tiktoken_version": tiktoken.__version__,
                "tokens": tokens,
                "runs": args.runs,
                "median_mb_s": statistics.median(rates),
            }
        )
    )


if __name__ == "__main__":
    main()
