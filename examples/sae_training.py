"""A sparse autoencoder trained with SAELens on a vinterp activation dataset.

Two hundred prompts' residual stream after layer 6 of the bundled model (every position but
the first) is written by `llm.extract` to a Hugging Face `datasets` folder. SAELens's
`SAETrainer` trains a standard (ReLU, L1) SAE four times as wide as the residual on those rows,
fed through its documented extension point for activation sources other than TransformerLens:
a `DataProvider`, an iterator of (batch, d_in) tensors, here random batches of the dataset's
memory-mapped shards (`vinterp.store.site_shards`). The last tenth of the prompts is held out;
the fraction of their rows' variance the SAE explains says whether it learned more than the
training rows' mean.
The SAE is saved in SAELens's format (cfg.json, sae_weights.safetensors).

    .venv/bin/python examples/sae_training.py [--out DIR] [--backend hf]
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from sae_lens import SAETrainer, StandardTrainingSAE, StandardTrainingSAEConfig
from sae_lens.config import SAETrainerConfig

import vinterp
from vinterp import plot
from vinterp.store import site_shards

SITE = "layers.6.output"
SUBJECTS = [
    "The river", "My grandmother", "The old computer", "A small bird", "The city council",
    "Every student", "The recipe", "Our team", "The mountain road", "A quiet library",
]  # fmt: skip
ACTIONS = [
    "was known for", "slowly changed", "always needed", "quietly remembered", "never explained",
    "carefully measured", "suddenly revealed", "often described", "rarely mentioned", "built",
    "lost", "carried", "painted", "counted", "followed", "questioned", "repaired", "ignored",
    "celebrated", "studied",
]  # fmt: skip
EXPANSION = 4
BATCH = 256
STEPS = 300
L1 = 2.0
LR = 1e-3
HELD_OUT = 0.1
SEED = 0


def prompts() -> list[str]:
    return [
        f"{subject} {action} the story of the {k}th winter, and nobody asked why."
        for k, (subject, action) in enumerate((s, a) for s in SUBJECTS for a in ACTIONS)
    ]


class LossRecordingTrainer(SAETrainer):
    """SAELens's trainer, keeping each step's loss for the picture."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.losses: list[float] = []

    def step(self, batch: torch.Tensor) -> Any:
        output = super().step(batch)
        self.losses.append(output.loss.item())
        return output


def batches(rows: torch.Tensor, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """SAELens's DataProvider: random (BATCH, d_in) float32 batches, forever."""
    while True:
        for index in torch.randperm(len(rows), generator=generator).split(BATCH):
            if len(index) == BATCH:
                yield rows[index].float()


def explained_variance(sae: StandardTrainingSAE, rows: torch.Tensor, mean: torch.Tensor) -> float:
    """1 - |x - sae(x)|^2 / |x - mean|^2 over `rows` (0: no better than the mean)."""
    with torch.no_grad():
        x = rows.float()
        error = (x - sae.decode(sae.encode(x))).pow(2).sum()
        return float(1 - error / (x - mean).pow(2).sum())


def run(llm: vinterp.LLM, out_dir: Path) -> dict[str, Any]:
    """Extract, train, plot the loss; return the numbers behind the picture."""
    out_dir = Path(out_dir)
    extraction = llm.extract(
        prompts(), SITE, skip_first=1, out=out_dir / "sae_acts", use_tqdm=False
    )
    rows = torch.cat(site_shards(out_dir / "sae_acts", SITE))
    prompt = torch.as_tensor(extraction.dataset["prompt"])
    held = prompt >= len(prompts()) * (1 - HELD_OUT)  # the last prompts: text never trained on
    train, test = rows[~held], rows[held]
    generator = torch.Generator().manual_seed(SEED)
    d_in = rows.shape[1]
    torch.manual_seed(SEED)
    sae = StandardTrainingSAE(
        StandardTrainingSAEConfig(d_in=d_in, d_sae=EXPANSION * d_in, l1_coefficient=L1)
    )
    config = SAETrainerConfig(
        total_training_samples=STEPS * BATCH, train_batch_size_samples=BATCH, lr=LR, lr_end=LR
    )
    trainer = LossRecordingTrainer(config, sae, batches(train, generator))
    trainer.fit()
    mean = train.float().mean(0)
    fve = explained_variance(sae, test, mean)
    sae.save_model(str(out_dir / "sae"))
    png = plot.line(
        range(1, len(trainer.losses) + 1),
        {"SAELens training loss (MSE + L1)": trainer.losses},
        xlabel="step",
        ylabel="loss",
        title=f"SAE on {SITE} ({len(train)} rows, {EXPANSION}x): held-out FVE {fve:.2f}",
        path=out_dir / "sae_training.png",
    )
    result = {
        "rows": len(rows),
        "dataset_rows": len(extraction.dataset),
        "losses": trainer.losses,
        "held_out_fve": fve,
        "train_fve": explained_variance(sae, train, mean),
        "png": png,
    }
    print(
        f"{len(rows)} rows of {SITE}; loss {trainer.losses[0]:.1f} -> {trainer.losses[-1]:.2f}; "
        f"held-out variance explained {fve:.3f} (the rows' mean explains 0)"
    )
    return result


if __name__ == "__main__":
    from _common import main  # examples/_common.py: --out DIR, --backend, the engine start

    main(run, __doc__)
