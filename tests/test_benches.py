"""The benchmarks that build on the product's retrieval API run against it as it stands: each is a
documented command (docs/benchmarks.md), and a change of that API once left two of them failing
on their first call. Tiny sizes: these check that a benchmark runs and reports what the product
computes, not its speed.
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


@pytest.fixture(autouse=True)
def _quiet_faiss_threads():
    """FAISS on one thread here: these sizes gain nothing from more, and the suite shares 2 cores."""
    import faiss

    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(before)
