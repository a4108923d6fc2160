"""The benchmarks that call the product's own API run against it as it stands: each is a documented
command (docs/benchmarks.md), and a change of the retrieval API once left two of them failing on
their first call. Tiny sizes: these check that a benchmark runs and reports what the product
computes, not its speed. (The ones that start processes, Ray or DeepSpeed take seconds to tens of
seconds each and are left to their users.)
"""

import importlib.util
import re

import pytest

from tests.corpora import ROOT, SEQ_CHUNKS


def bench(name: str):
    """bench/<name>.py as a module (bench/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def table_row(out: str, index: str, rerank: str) -> list[str]:
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == [index]]
    row = next((r for r in rows if rerank in r), None)
    assert row is not None, out
    return row


def test_the_index_benchmark_builds_and_searches_through_the_product(tmp_path, capsys):
    index = bench("index")
    index.queries_per_second.__defaults__ = (0.05,)   # seconds each rate is timed over: a check, not a figure
    code = index.main(["--n", "2000", "--queries", "50", "--clusters", "20", "--factory", "IVF16,PQ8x4",
                       "--nprobe", "4", "--train-sample", "1000", "--shard-size", "500", "--rounds", "1",
                       "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert table_row(out, "Flat", "no")[-1] == "1.0000"          # exact search finds the exact neighbours
    assert 0.0 < float(table_row(out, "IVF16,PQ8x4", "yes")[-2]) <= 1.0
    assert re.search(r"^goal (met|missed)", out, re.M), out


def test_the_neighbour_benchmark_gives_the_products_neighbours(built, capsys):
    root, _, result = built
    code = bench("neighbours").main(["--workdir", str(root), "--factory", "Flat", "--rounds", "1",
                                     "--chunks-per-seq", str(SEQ_CHUNKS)])
    out = capsys.readouterr().out
    assert code == 0, out
    missing = sum(split["missing"] for split in result["neighbours"]["splits"].values())
    assert int(table_row(out, "Flat", "no")[-1].replace(",", "")) == missing, (out, missing)


def test_the_copies_benchmark_finds_the_builds_copies_and_embeds_both_ways(built, capsys):
    root, store, _ = built
    from retropipe.retrieval.copies import find_copies

    code = bench("copies").main(["--workdir", str(root)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"1 parts, {len(store.split('train')) + len(store.split('validation')):,} chunks, " \
           f"{len(find_copies([store])):,} exact copies" in out, out
    assert "copies skipped" in out and "every chunk embedded" in out and "faster" in out, out


def test_the_generation_benchmark_samples_the_same_tokens_with_and_without_the_cache(one_thread, capsys):
    bench("generate").main(["--prompt", "8", "--new", "12", "--chunk-len", "8", "--repeat", "1"])
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["gpt2"], ["retro"])}
    assert sorted(rows) == ["gpt2", "retro"] and all(row[-1] == "yes" for row in rows.values()), out


def test_the_scale_benchmark_fits_a_line_for_every_stage(one_thread, capsys):
    scale = bench("scaling/scale")
    assert scale.main(["--tiny", "--in-process"]) == 0    # every stage, in this process: imports paid once
    out = capsys.readouterr().out
    for stage in scale.STAGES:
        assert re.search(rf"^{stage}: time exponent -?\d+\.\d\d, memory exponent -?\d+\.\d\d$", out, re.M), out
    assert re.search(r"^goal time exponent ≤ 1\.15 for every stage: (met|missed by .+)$", out, re.M), out
    assert scale.main(["--tiny", "--stages", "prepare"]) == 0    # the benchmark's way: a process per size
    assert re.search(r"^prepare: time exponent .+\n  at [\d,]+ chunks: ", capsys.readouterr().out, re.M)


@pytest.fixture(autouse=True)
def _quiet_faiss_threads():
    """FAISS on one thread here: these sizes gain nothing from more, and the suite shares 2 cores."""
    import faiss

    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(before)
