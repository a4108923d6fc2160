"""Convert GPT-2 weights between a Hugging Face directory (or hub name) and our model directory.

    python launch/convert_gpt2.py --from-hf HF_DIR --out DIR     # HF GPT2LMHeadModel → ours
    python launch/convert_gpt2.py --from-hf gpt2 --out DIR       # a hub name, where the hub is reachable
    python launch/convert_gpt2.py --to-hf DIR --out HF_DIR       # ours (kind gpt2) → HF

Both directions are exact (same logits in fp32). --from-hf takes a directory, or a hub model name
resolved through huggingface_hub's own cache (~/.cache/huggingface; HF_HUB_OFFLINE=1 uses the
cache only): without a network, a name not in the cache is an error, exit 2. --to-hf also writes
generation_config.json and, for a model with GPT-2's vocabulary (50,257 tokens or more), the GPT-2
tokenizer (vocab.json, merges.txt, from the bundled BPE files; no download), so that
`transformers.pipeline("text-generation", model=HF_DIR)` works offline. The output is written to
a temporary sibling directory and moved into place; an existing --out is only replaced with --force.
"""

from __future__ import annotations

import sys
from pathlib import Path

from retropipe.launch.cli import entry_parser
from retropipe.training.models.gpt2 import GPT2
from retropipe.training.models.hf_interop import GPT2_VOCAB, HFFormatError, gpt2_from_hf, hf_source, save_hf
from retropipe.training.models.io import ModelFormatError, load_model, save_model, write_dir_atomically


def main(argv: list[str] | None = None) -> int:
    parser = entry_parser(__doc__, config=False, progress=False)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--from-hf", metavar="HF_DIR_OR_NAME",
                        help="Hugging Face GPT-2 directory, or hub model name (e.g. gpt2), to import")
    source.add_argument("--to-hf", metavar="DIR", help="our model directory (kind gpt2) to export")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    args = parser.parse_args(argv)
    out = Path(args.out)
    try:
        if out.exists() and any(out.iterdir()) and not args.force:
            raise FileExistsError(f"{out} exists and is not empty (use --force to replace it)")
        if args.from_hf:
            try:
                src = hf_source(args.from_hf)  # a directory, or a hub name through huggingface_hub's cache
            except HFFormatError as e:
                raise HFFormatError(f"--from-hf: {e}") from None
        else:
            src = Path(args.to_hf)
            if not src.is_dir():
                raise FileNotFoundError(f"input directory not found: {src}")
        if out.resolve() == src.resolve():
            raise FileExistsError("--out must differ from the input directory")
        note = ""
        if args.from_hf:
            model = gpt2_from_hf(src)
            save_model(model, out)
        else:
            model = load_model(src)
            if not isinstance(model, GPT2):
                raise ModelFormatError(f"{src}: only GPT-2 models export to Hugging Face (kind is {model.cfg.kind!r})")
            tokenizer = []
            write_dir_atomically(out, lambda tmp: tokenizer.append(save_hf(model, tmp)))
            note = ("; GPT-2 tokenizer and generation config" if tokenizer[0] else
                    f"; generation config, no tokenizer: vocab_size {model.cfg.vocab_size} is smaller than GPT-2's "
                    f"{GPT2_VOCAB:,}")
    except (OSError, HFFormatError, ModelFormatError, ValueError) as e:
        print(f"convert_gpt2: error: {e}", file=sys.stderr)
        return 2
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out} ({'ours' if args.from_hf else 'Hugging Face'} format, {n:,} parameters{note})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
