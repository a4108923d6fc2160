"""Benchmark chunk embedding: in-process `embed` vs the Ray Data runner with 1 and 2 actors, and MFU.

    python bench/embed.py [--chunks 1000] [--corpus ../shared/corpora/techdocs.jsonl.gz] [--actors 1,2]
                          [--precisions fp32,auto] [--backends auto,sentence-transformers] [--model DIR]
    # a GPU machine without Ray: in-process only
    python bench/embed.py --device cuda --actors "" --precisions fp32,fp16,bf16

Prints, measured side by side in one run: chunks/s of the bundled all-MiniLM-L6-v2 on the
first N training chunks of a freshly prepared corpus, (a) in this process with all cores
(`retrieval.embed_job.embed`, job by job as the serial runner does) in each of `--precisions`
(`retrieval.embed_precision` values; auto = what a build on this device picks), with each one's
speed over fp32's and how many of each chunk's top-2 neighbour ids among these chunks (cosine,
itself excluded) stay those of fp32; and (b) through `retrieval.ray_embed.RayEmbedRunner` with
1 and 2 actors, in the last precision; and each one's model FLOP utilisation: model FLOPs per
chunk × chunks/s over the matmul FLOP/s of its dtype measured in the same run. Goal on CPU:
≥ 0.6 of that peak; on a GPU the figure to record is chunks/s. `--backends`: the model computed
as builds compute it (auto: retrieval/bert.py's plain-torch BERT) and through sentence-transformers,
in-process in every precision and through Ray (the actors' start-up, which imports the
library, counts end to end): the ratio of their chunks/s and whether their vectors are the same.
`--actors ""` measures in-process only, and needs no Ray.

Model FLOPs of a BERT encoder on a sequence padded to T WordPiece tokens (the tokens really
fed: [CLS], [SEP] and the padding to the longest text of its sub-batch included):
2 · P · T for the weight matmuls (P = encoder parameters, embeddings excluded) plus
4 · L · T² · d for attention scores and their weighted sum; plus 2 · P_pooler once.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from retropipe.data.config import DEFAULT_CORPUS, DataConfig  # noqa: E402
from retropipe.data.prepare import prepare  # noqa: E402
from retropipe.data.store import ChunkStore  # noqa: E402
from retropipe.data.tokenizer import get_tokenizer  # noqa: E402
from retropipe.launch.ray_utils import RayExecutor  # noqa: E402
from retropipe.retrieval.embed_job import (EmbedJob, EmbedSpec, chunk_texts, embed, load_embedder, sub_batches,  # noqa: E402
                                       plan_jobs, resolve_embed_precision, resolve_model_path, token_lengths)
from retropipe.retrieval.config import RetrievalConfig  # noqa: E402
from retropipe.retrieval.ray_embed import EmbedChunks, RayEmbedRunner  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def matmul_flops(device: str, size: int, reps: int, precision: str = "fp32") -> float:
    """Best FLOP/s of a size×size matmul in `precision` on this device: the denominator of the MFU."""
    from bench.model_step import matmul_flops as best_matmul

    return best_matmul(device, DTYPES[precision], size, reps)


def first_jobs(store: ChunkStore, n: int, batch_size: int) -> list[EmbedJob]:
    """The jobs build_index would plan for the training split, cut after the first n chunks."""
    jobs = []
    for shard in range(len(store.manifest["shards"]["train"])):
        for job in plan_jobs(store, "train", shard, batch_size):
            if job.start >= n:
                return jobs
            jobs.append(EmbedJob(job.split, job.shard, job.start, min(job.stop, n)))
    return jobs


def flops_per_chunk(model, texts_per_job: list[list[str]], sub_batch: int | None) -> tuple[float, float, float]:
    """(model FLOPs per chunk, mean padded WordPiece length, mean real length) for these jobs,
    sub-batched exactly as `embed` does (`sub_batches`)."""
    if hasattr(model, "token_ids"):               # retrieval/bert.PlainBert: no pooler is computed
        encoder, pooler, layers, width = model.encoder, None, len(model.encoder["layer"]), model.dim
    else:                                         # a SentenceTransformer: transformers computes the pooler
        bert = model[0].auto_model
        encoder, pooler = bert.encoder, getattr(bert, "pooler", None)
        layers, width = bert.config.num_hidden_layers, bert.config.hidden_size
    p_enc = sum(p.numel() for p in encoder.parameters())
    p_pool = sum(p.numel() for p in pooler.parameters()) if pooler is not None else 0
    flops, padded, real, count = 0.0, 0, 0, 0
    for texts in texts_per_job:
        lengths = np.array(token_lengths(model, texts))
        for idx in sub_batches(lengths, model.device, sub_batch):
            group = lengths[idx]
            b, t = len(group), int(group.max())
            flops += b * (2 * p_enc * t + 4 * layers * t * t * width + 2 * p_pool)
            padded, real, count = padded + b * t, real + int(group.sum()), count + b
    return flops / count, padded / count, real / count


def run_inprocess(model, texts_per_job: list[list[str]], sub_batch: int | None = None) -> tuple[float, np.ndarray]:
    """(seconds, vectors) of embedding every job in this process (one `embed` call per job, like
    the serial runner)."""
    t0 = time.perf_counter()
    vectors = [embed(model, texts, sub_batch) for texts in texts_per_job]
    sync(model.device.type)
    return time.perf_counter() - t0, np.concatenate(vectors)


def top2(vectors: np.ndarray) -> np.ndarray:
    """(n, 2) ids of each vector's two nearest others by cosine (vectors are unit length)."""
    sims = vectors.astype(np.float32) @ vectors.astype(np.float32).T
    np.fill_diagonal(sims, -np.inf)
    return np.argsort(-sims, axis=1, kind="stable")[:, :2]


def agreement(ids: np.ndarray, reference: np.ndarray) -> float:
    """Share of the top-2 ids of each row that are also among the reference's top 2."""
    return float(np.mean([len(set(a) & set(b)) / 2 for a, b in zip(ids, reference)]))


class TimedEmbedChunks(EmbedChunks):
    """The product's actor UDF, logging the wall-clock span of every batch it embeds.

    Lines "start end chunks" go to timing/<pid>.txt beside the chunk store (the one path the
    actor is handed), so the driver can tell embedding time from actor start-up."""

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        start = time.time()
        out = super().__call__(batch)
        log = Path(self.spec.data_dirs[0]).parent / "timing" / f"{os.getpid()}.txt"
        with open(log, "a") as f:
            f.write(f"{start} {time.time()} {len(out['chunk'])}\n")
        return out


def steady_rate(timing_dir: Path) -> float:
    """Chunks/s while every actor was embedding: from the last actor's first batch to the first
    actor's last batch, batches counted pro rata to their overlap with that window."""
    spans = [np.loadtxt(p, ndmin=2) for p in timing_dir.glob("*.txt")]
    begin, end = max(s[:, 0].min() for s in spans), min(s[:, 1].max() for s in spans)
    if end <= begin:  # one actor finished before another began: no common window
        return float("nan")
    chunks = 0.0
    for s in spans:
        overlap = np.clip(np.minimum(s[:, 1], end) - np.maximum(s[:, 0], begin), 0, None)
        chunks += float((s[:, 2] * overlap / (s[:, 1] - s[:, 0])).sum())
    return chunks / (end - begin)


def run_ray(runner: RayEmbedRunner, spec: EmbedSpec, jobs: list[EmbedJob]) -> tuple[float, float]:
    """(chunks/s end to end, chunks/s steady) of one runner execution.

    End to end includes starting the actors and loading a model in each (Ray Data makes a new
    actor pool per execution); the steady rate, measured inside the actors, is what a real
    database (hours of embedding) runs at."""
    timing = Path(spec.data_dirs[0]).parent / "timing"
    shutil.rmtree(timing, ignore_errors=True)
    timing.mkdir()
    t0 = time.perf_counter()
    n = sum(len(vectors) for _, vectors in runner(spec, jobs))
    return n / (time.perf_counter() - t0), steady_rate(timing)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=1000, help="training chunks embedded per measurement")
    parser.add_argument("--corpus", default=DEFAULT_CORPUS)
    parser.add_argument("--max-documents", type=int, default=3000, help="documents prepared (0 = all)")
    parser.add_argument("--actors", default="1,2", help="Ray actor counts to measure (\"\": none, no Ray)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the best of each is kept")
    parser.add_argument("--batch-size", type=int, default=RetrievalConfig().embed_batch_size,
                        help="chunks per job (retrieval.embed_batch_size)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--precisions", default="fp32,auto",
                        help="retrieval.embed_precision values measured in-process; the last one also through Ray")
    parser.add_argument("--backends", default="auto,sentence-transformers",
                        help="how the model is computed (embedder.load_embedder): auto (the plain-torch BERT for "
                             "the bundled model); sentence-transformers, compared with auto in every precision "
                             "in-process and in the Ray one through Ray")
    parser.add_argument("--sub-batch", type=int, default=None,
                        help="texts per forward inside a job (default: the device's, embed.sub_batches)")
    parser.add_argument("--model", default="", help="retrieval.embedder: a model directory (\"\": the bundled one)")
    args = parser.parse_args(argv)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)
    actor_counts = [int(a) for a in args.actors.split(",") if a]
    precisions = list(dict.fromkeys(resolve_embed_precision(p, device) for p in args.precisions.split(",") if p))

    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        prepare(DataConfig(corpus=args.corpus, max_documents=args.max_documents), data_dir, progress=False)
        store = ChunkStore(data_dir)
        jobs = first_jobs(store, args.chunks, args.batch_size)
        n = jobs[-1].stop if jobs else 0
        encoding = get_tokenizer(store.manifest["tokenizer"])
        train = store.split("train")
        texts_per_job = [chunk_texts(train.tokens(np.arange(j.start, j.stop)), train.lengths[j.start:j.stop],
                                     encoding, store.eot_id) for j in jobs]
        model_path = resolve_model_path(args.model)
        backends = [b for b in args.backends.split(",") if b]
        # label → (precision, backend, model); "fp32" is the product's path, "fp32 sentence-transformers" the other
        models = {p: (p, "auto", load_embedder(model_path, device=device, precision=p)) for p in precisions}
        other = [b for b in backends if b != "auto"]
        for backend in other:
            for p in precisions:
                models[f"{p} {backend}"] = (p, backend, load_embedder(model_path, device=device, precision=p,
                                                                      backend=backend))
        sub_batch = args.sub_batch
        fpc, padded_len, real_len = flops_per_chunk(models[precisions[0]][2], texts_per_job, sub_batch)
        name = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {cores} cores"
        print(f"device: {name}; load average {os.getloadavg()[0]:.2f}; torch {torch.__version__}; "
              f"TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM', '(unset: threads)')}")
        print(f"corpus {args.corpus}: first {n:,} training chunks, in {len(jobs)} jobs of {args.batch_size} "
              f"and sub-batches of {sub_batch or 'the device’s size (embed.sub_batches)'}")
        print(f"WordPiece tokens per chunk: {real_len:.1f} real, {padded_len:.1f} fed (padded); "
              f"model FLOPs per chunk {fpc / 1e9:.3f} GFLOP")
        for _, _, model in models.values():
            run_inprocess(model, texts_per_job[:2], sub_batch)  # warm-up: first calls allocate and pick kernels

        ray_precision = precisions[-1]
        specs = {b: EmbedSpec((str(data_dir.resolve()),), str(model_path), store.manifest["tokenizer"],
                              sub_batch=args.sub_batch, precision=ray_precision, backend=b) for b in ["auto", *other]}
        executor = RayExecutor(num_cpus=cores) if actor_counts else None
        peaks, rates, vectors = {}, {}, {}
        size, reps = (8192, 20) if device == "cuda" else (2048, 5)

        def measure_peak(precision):
            peaks[precision] = max(peaks.get(precision, 0.0), matmul_flops(device, size, reps, precision))

        try:
            for _ in range(args.rounds):
                # Interleaved, the peak re-measured beside every variant and the best kept: the
                # machine is shared, and a neighbour must slow numerator and denominator alike.
                for label, (precision, _, model) in models.items():
                    measure_peak(precision)
                    seconds, vectors[label] = run_inprocess(model, texts_per_job, sub_batch)
                    rates.setdefault(f"in-process {label}", []).append(n / seconds)
                    print(f"  measured in-process {label}: {n / seconds:.1f} chunks/s", flush=True)
                for actors in actor_counts:
                    for backend, spec in specs.items():
                        measure_peak(ray_precision)
                        runner = RayEmbedRunner(executor, actors, args.device, udf=TimedEmbedChunks)
                        e2e, steady = run_ray(runner, spec, jobs)
                        tag = "" if backend == "auto" else f" {backend}"
                        rates.setdefault(f"ray e2e {actors}{tag}", []).append(e2e)
                        rates.setdefault(f"ray {actors}{tag}", []).append(steady)
                        print(f"  measured Ray {actors} actor(s), {ray_precision}{tag}: {steady:.1f} chunks/s steady, "
                              f"{e2e:.1f} end to end", flush=True)
            for precision in peaks:
                measure_peak(precision)
        finally:
            if executor is not None:
                executor.close()

    best = {key: float(np.nanmax(values)) for key, values in rates.items()}
    print("matmul " + ", ".join(f"{p} {size}²: {peak / 1e9:,.1f} GFLOP/s" for p, peak in peaks.items())
          + f" (best in this run); load average at the end {os.getloadavg()[0]:.2f} on {cores} cores")
    print(f"\n{'variant':<58} {'chunks/s':>9} {'GFLOP/s':>8} {'of peak':>8}")
    variants = [(f"in-process embed, all cores, {label}", f"in-process {label}", p) for label, (p, _, _) in models.items()]
    for a in actor_counts:
        for tag in ["", *(f" {b}" for b in other)]:
            variants += [(f"Ray Data, {a} actor(s), {ray_precision}{tag}, steady", f"ray {a}{tag}", ray_precision),
                         (f"Ray Data, {a} actor(s), {ray_precision}{tag}, e2e", f"ray e2e {a}{tag}", ray_precision)]
    for label, key, precision in variants:
        rate = best[key]
        print(f"{label:<58} {rate:>9.1f} {rate * fpc / 1e9:>8.1f} {rate * fpc / peaks[precision]:>8.1%}")
    reference = precisions[0]
    for precision in precisions[1:]:
        print(f"{precision} vs {reference} in-process: {best[f'in-process {precision}'] / best[f'in-process {reference}']:.2f}× "
              f"the chunks/s; top-2 neighbour ids unchanged: "
              f"{agreement(top2(vectors[precision]), top2(vectors[reference])):.1%} (goal ≥ 98%)")
    if device == "cpu":
        top = max(rate / peaks[p] for label, key, p in variants if not key.startswith("ray e2e") for rate in [best[key]])
        print(f"best steady MFU {top * fpc:.2f} of the matmul peak in its dtype (goal ≥ 0.6)")
    for backend in other:
        for p in precisions:
            label = f"{p} {backend}"
            same = np.array_equal(vectors[p], vectors[label])
            gap = "" if same else f" (largest difference {np.abs(vectors[p] - vectors[label]).max():.1e})"
            print(f"plain-torch BERT vs {backend}, {p} in-process: "
                  f"{best[f'in-process {p}'] / best[f'in-process {label}']:.2f}× the chunks/s; vectors "
                  f"{'bit for bit the same' if same else 'differ'}{gap}")
        for a in actor_counts:
            print(f"  Ray {a} actor(s), {ray_precision}: steady {best[f'ray {a}'] / best[f'ray {a} {backend}']:.2f}×, "
                  f"end to end (actors' start-up included) {best[f'ray e2e {a}'] / best[f'ray e2e {a} {backend}']:.2f}×")
    if len(actor_counts) > 1:
        lo, hi = actor_counts[0], actor_counts[-1]
        print(f"Ray {hi} vs {lo} actor(s): {best[f'ray {hi}'] / best[f'ray {lo}']:.2f}× steady")
    return 0


if __name__ == "__main__":
    sys.exit(main())
