"""Benchmark data preparation: raw tiktoken vs RetroPipe prep with 1 and 2 Ray workers.

    python bench/prepare_data.py [--corpus ../shared/corpora/techdocs.jsonl.gz] [--max-documents N]

Prints, measured side by side in one run: single-process tiktoken tokens/s (tokenization
alone, texts already in memory), RetroPipe's prepare tokens/s (read → tokenize → chunk →
write Arrow shards) with 1 and 2 workers on a warm Ray, their ratios, and peak memory.
Goals: 2 workers ≥ 1.7× 1 worker; 1 worker ≥ 0.6× raw tiktoken.
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from retropipe.data.config import DEFAULT_CORPUS, DataConfig  # noqa: E402
from retropipe.data.prepare import prepare  # noqa: E402
from retropipe.data.corpus_formats import read_documents  # noqa: E402
from retropipe.data.tokenizer import get_tokenizer  # noqa: E402
from retropipe.launch.ray_utils import RayExecutor  # noqa: E402


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default=DEFAULT_CORPUS)
    parser.add_argument("--max-documents", type=int, default=0)
    parser.add_argument("--docs-per-shard", type=int, default=256)
    args = parser.parse_args()

    texts = [d.text for d in read_documents(args.corpus, max_documents=args.max_documents)]
    enc = get_tokenizer("gpt2")
    enc.encode_ordinary_batch(texts[:100], num_threads=1)  # warm-up
    start = time.perf_counter()
    n_tokens = sum(len(t) + 1 for t in enc.encode_ordinary_batch(texts, num_threads=1))
    raw = n_tokens / (time.perf_counter() - start)
    print(f"corpus {args.corpus}: {len(texts):,} documents, {n_tokens:,} tokens")
    print(f"raw tiktoken, 1 process        {raw:>12,.0f} tokens/s")
    del texts

    executor = RayExecutor(num_cpus=2)
    rates = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            warm = DataConfig(corpus=args.corpus, max_documents=2 * args.docs_per_shard,
                              docs_per_shard=args.docs_per_shard, num_workers=2)
            prepare(warm, Path(tmp) / "warm", executor=executor, progress=False)  # start Ray workers
            for workers in (1, 2, 1, 2):  # interleaved: the machine's speed drifts
                cfg = DataConfig(corpus=args.corpus, max_documents=args.max_documents,
                                 docs_per_shard=args.docs_per_shard, num_workers=workers)
                out = Path(tmp) / f"w{workers}-{len(rates.get(workers, []))}"
                m = prepare(cfg, out, executor=executor, progress=False)
                rates.setdefault(workers, []).append(m["run"]["tokens_per_second"])
    finally:
        executor.close()
    one, two = max(rates[1]), max(rates[2])
    print(f"RetroPipe prepare, 1 worker    {one:>12,.0f} tokens/s   ({one / raw:.2f}× raw tiktoken; goal ≥ 0.6)")
    print(f"RetroPipe prepare, 2 workers   {two:>12,.0f} tokens/s   ({two / one:.2f}× 1 worker; goal ≥ 1.7)")
    print(f"peak RSS of the driver         {peak_rss_mb():>12,.0f} MB")


if __name__ == "__main__":
    main()
