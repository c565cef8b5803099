"""One rank of the tests' launches: load a split set on the CPU (gloo, the Triton interpreter),
run a forward and transformers' own greedy loop, and save what this rank saw.

Run as ``python -m tests.distributed.rank_worker PREPARED OUT_DIR`` under the rank variables."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

from prepkit.distributed.session import leave, start  # noqa: E402
from prepkit.errors import PrepkitError  # noqa: E402
from prepkit.integrations.gpt_oss_loader import from_prepared  # noqa: E402

PROMPT = [[3, 17, 42, 99, 7, 128, 200, 11]]
NEW_TOKENS = 4


def main(prepared: Path, out_dir: Path) -> int:
    group = start("cpu")
    rank = group.rank if group is not None else 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no tuned tactic for tiny dims
            model = from_prepared(prepared, device="cpu")
            ids = torch.tensor(PROMPT)
            with torch.no_grad():
                logits = model(ids).logits
                tokens = type(model).generate(
                    model, ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
                )
    except PrepkitError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    finally:
        leave()
    torch.save({"logits": logits.float(), "tokens": tokens}, out_dir / f"rank{rank}.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
