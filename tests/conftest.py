"""What every test shares: an offline, quiet environment, set before any test module imports a library.

The test suite never downloads: Hugging Face libraries are put in offline mode here (not by the
Makefile, so that `make demo` and the CLIs can reach the hub when a user names a hub model),
Ray does not report usage, and tokenizers do not fork thread pools under Ray and DeepSpeed.
Subprocesses started by tests inherit this environment.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"

import pytest  # noqa: E402 (after the environment, on purpose)
import torch  # noqa: E402


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """A topic store and its retrieval database, built once in-process: the reference that the
    retrieval tests (in-process and on Ray) compare against. Read it; copy it to change it."""
    from retropipe.retrieval.build_database import build_retrieval
    from tests.corpora import SEQ_CHUNKS, make_store, retrieval_cfg, topic_docs

    root = tmp_path_factory.mktemp("built")
    store = make_store(root, topic_docs())
    result = build_retrieval(retrieval_cfg(), store, root / "retrieval", chunks_per_seq=SEQ_CHUNKS)
    return root, store, result


@pytest.fixture(scope="module")
def one_thread():
    """torch on one intra-op thread for a module. Batch-one sampling from tiny models gains nothing
    from more, and on a shared 2-core machine their spin-waiting turned a 0.1 s generation into
    ~9 s; an in-process reference build embeds on one thread as a one-CPU Ray actor does."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def kernels_unheld(monkeypatch):
    """For a test that fakes the CPU's flags: the variables that hold torch's kernels below the
    CPU (set when the suite runs on AVX2 kernels) cleared, so the faked flags decide alone."""
    from retropipe.data.cpu import HELD_KERNEL_VARIABLES

    for name in HELD_KERNEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
