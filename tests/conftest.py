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
