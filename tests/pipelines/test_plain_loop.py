"""The plain training loop (``adlm_model/train/plain_loop.py``) is the pipeline's loop without Ray or MLflow: on the
same rows in the same order and the seeds the pipeline derives for rank 0, its per-step losses and its final weights
equal a local-mode ``pipelines.train`` run's (the driver training in-process); a run cut short and resumed from its
checkpoint takes the same steps as an uninterrupted one."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from adlm_model import load_checkpoint
from adlm_model.train.plain_loop import PlainConfig, micro_batches, saved_step, train
from pipelines.core.seeds import TRAIN_DROPOUT, TRAIN_NOISE, derive_seed
from pipelines.training.config import TrainConfig, load_config
from tests.conftest import ROOT
from tests.support.data import TINY_MODEL, data_overrides

STEPS = 4


def _plain(cfg: TrainConfig, out_dir: Path | None = None, **kw) -> PlainConfig:
    """The recipe's settings as the plain loop's, with the noise and dropout seeds of the pipeline's rank 0
    (``pipelines/training/worker.py``: ``build``)."""
    o, seed = cfg.optim, cfg.run.seed
    return PlainConfig(**{
        "max_steps": cfg.run.max_steps, "accumulation": cfg.accumulation, "lr": o.lr, "betas": tuple(o.betas),
        "eps": o.eps, "weight_decay": o.weight_decay, "fused": o.fused, "warmup_steps": o.warmup_steps,
        "schedule": o.schedule, "min_lr_ratio": o.min_lr_ratio, "clip": o.clip, "ema": cfg.ema,
        "ema_warmup": cfg.ema_warmup, "seed": seed, "noise_seed": derive_seed(seed, TRAIN_NOISE, 0),
        "dropout_seed": derive_seed(seed, TRAIN_DROPOUT, 0), "out_dir": str(out_dir) if out_dir else None, **kw})


def test_the_plain_loop_takes_the_steps_of_a_local_pipeline_run(tiny_data: Path, workdir: Path,
                                                                 tmp_path: Path) -> None:
    """ADLM with dropout (the torch RNG), masking noise (the loop's generator), its step-dependent anchor weight,
    accumulation 2, warm-up and the EMA: every step's loss and the final weights and EMA weights agree with the
    pipeline's (bit for bit on one machine; float tolerance allows another thread count's rounding). The rows are
    the pipeline's own stream (``training_dataset``, no shuffle buffer), in its order. Another noise seed gives
    other losses, so the agreement is not a loss that ignores the noise; another dropout seed moves this tiny
    model's losses by a few parts in a million (caught by the loss tolerance from the third step) and its weights
    beyond the weights' tolerance."""
    import mlflow

    import pipelines.training.trainer as trainer
    from pipelines.training.checkpoints import latest_checkpoint
    from pipelines.training.data import plan_data

    cfg = load_config(ROOT / "configs" / "demo.yaml", [
        *data_overrides(tiny_data), *TINY_MODEL, "run.name=plain", "batch.global_batch=8", "batch.micro_batch=4",
        f"run.max_steps={STEPS}", "run.log_every=1", f"run.val_every={STEPS}", f"run.ckpt_every={STEPS}",
        "run.val_batches=1", "optim.warmup_steps=2", "ema=0.9", "data.shuffle_buffer=0", "scaling.num_workers=0",
        "mlflow.experiment=test-plain-loop"])
    threads = torch.get_num_threads()
    try:
        res = trainer.train(cfg, register=False)
        history = mlflow.MlflowClient().get_metric_history(res.run_id, "train/loss")
        want = [m.value for m in sorted(history, key=lambda m: m.step)]
        assert [m.step for m in sorted(history, key=lambda m: m.step)] == list(range(1, STEPS + 1))

        plan = plan_data(cfg, str(workdir))
        ds = trainer.training_dataset(cfg, plan)
        rows = torch.cat([b["input_ids"] for b in ds.iter_torch_batches(batch_size=cfg.batch.micro_batch,
                                                                          drop_last=True)])
        assert rows.shape[0] >= STEPS * cfg.batch.global_batch

        def batches(start: int):
            return micro_batches(rows, cfg.batch.micro_batch, start * cfg.accumulation)

        run = train(cfg.model, _plain(cfg, tmp_path / "plain"), batches)
        other = train(cfg.model, _plain(cfg, noise_seed=derive_seed(cfg.run.seed, TRAIN_NOISE, 1)), batches)
    finally:
        torch.set_num_threads(threads)
    assert run.losses == pytest.approx(want, rel=1e-6, abs=1e-7)
    assert other.losses[0] != pytest.approx(want[0], rel=1e-3)

    step, latest = latest_checkpoint(workdir / "ray_results" / "plain")
    assert step == STEPS == saved_step(tmp_path / "plain")
    for use_ema in (False, True):
        theirs, _, _ = load_checkpoint(latest, use_ema=use_ema)
        ours, _, meta = load_checkpoint(tmp_path / "plain", use_ema=use_ema)
        a, b = theirs.state_dict(), ours.state_dict()
        assert a.keys() == b.keys() and meta["step"] == STEPS
        assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in a), use_ema


VOCAB, LENGTH = 64, 16
ROWS = torch.randint(3, VOCAB, (48, LENGTH), generator=torch.Generator().manual_seed(0))


@pytest.mark.usefixtures("one_torch_thread")
def test_a_run_resumed_from_its_checkpoint_takes_the_uninterrupted_runs_steps(tmp_path: Path) -> None:
    """ADLM with dropout, killed during step 4 (its last checkpoint at step 2) and run again, equals an
    uninterrupted run of 6 steps (losses, weights, EMA weights and its update count): the checkpoint carries
    AdamW's state, both RNG streams and the step, and the rows continue where they stopped."""
    from adlm_model import preset

    cfg = preset("tiny", kind="adlm", vocab_size=VOCAB, mask_id=2, seq_len=LENGTH, hidden=32, heads=2, n_blocks=1,
                 denoiser_blocks=1, cond_dim=16, dropout=0.1, gamma_horizon=6)
    settings = PlainConfig(max_steps=6, accumulation=2, lr=3e-3, warmup_steps=2, schedule="cosine", ema=0.9,
                           noise_seed=5, dropout_seed=6, ckpt_every=2)

    def batches(start: int):
        return micro_batches(ROWS, 4, start * 2)

    def killed_in_step_4(start: int):
        for i, b in enumerate(batches(start)):
            if i == 7:
                raise KeyboardInterrupt
            yield b

    whole = train(cfg, dataclasses.replace(settings, out_dir=str(tmp_path / "whole")), batches)
    cut = dataclasses.replace(settings, out_dir=str(tmp_path / "cut"))
    with pytest.raises(KeyboardInterrupt):
        train(cfg, cut, killed_in_step_4)
    assert saved_step(tmp_path / "cut") == 2
    torch.manual_seed(123)  # whatever the fresh process's RNG holds, the checkpoint's streams take over
    rest = train(cfg, cut, batches)
    assert rest.step == 6 and rest.losses == whole.losses[2:]
    assert all(torch.equal(x, y) for x, y in zip(whole.model.state_dict().values(), rest.model.state_dict().values(),
                                                 strict=True))
    assert all(torch.equal(x, y) for x, y in zip(whole.ema.shadow.values(), rest.ema.shadow.values(), strict=True))
    assert whole.ema.num_updates == rest.ema.num_updates == 6
