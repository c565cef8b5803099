"""One rank of the tests' launches: load a split set on the CPU (gloo, the Triton interpreter),
run a forward and transformers' own greedy loop, and save what this rank saw.

Run as ``python -m tests.distributed.rank_worker PREPARED[,PREPARED...] OUT_DIR`` under the rank
variables; with several folders, rank r opens the r-th (a launch whose ranks disagree)."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

from prepkit.distributed.decoder import build_rank_decoder  # noqa: E402
from prepkit.distributed.session import leave, start  # noqa: E402
from prepkit.errors import PrepkitError  # noqa: E402
from prepkit.integrations.gpt_oss_loader import from_prepared  # noqa: E402

# Two rows, the second left-padded: the mask reaches every rank's attention.
PROMPT = [[3, 17, 42, 99, 7, 128, 200, 11], [0, 0, 0, 5, 91, 33, 160, 250]]
MASK = [[1] * 8, [0, 0, 0, 1, 1, 1, 1, 1]]
NEW_TOKENS = 6


def main(folders: list[Path], out_dir: Path) -> int:
    try:
        group = start("cpu")
        rank = group.rank if group is not None else 0
        prepared = folders[rank % len(folders)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no tuned tactic for tiny dims
            # fp32 between modules: the ranks' partial sums then round as one process's sums do
            model = from_prepared(prepared, device="cpu", dtype=torch.float32)
            ids, mask = torch.tensor(PROMPT), torch.tensor(MASK)
            with torch.no_grad():
                logits = model(ids, attention_mask=mask).logits
                tokens = type(model).generate(
                    model, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
                )
            # prepkit's decode step, summing the ranks' shares itself (reduce and gather hooks)
            decoder = build_rank_decoder(model, ids.shape[1] + NEW_TOKENS, len(PROMPT), "modules")
            step_tokens = decoder.generate(ids, NEW_TOKENS, attention_mask=mask)
    except PrepkitError as err:
        # One write: ranks share the stream, and print's separate newline could land after
        # another rank's line.
        sys.stderr.write(f"Error: {err}\n")
        return err.exit_code
    finally:
        leave()
    saved = {"logits": logits.float(), "tokens": tokens, "step_tokens": step_tokens}
    torch.save(saved, out_dir / f"rank{rank}.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main([Path(p) for p in sys.argv[1].split(",")], Path(sys.argv[2])))
