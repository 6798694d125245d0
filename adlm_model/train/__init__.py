"""One training step and what it needs: ``train_step`` (micro-batches, autocast, objective, clipping, fused AdamW,
schedule, EMA; compiled on CUDA), ``ema``, ``flops`` (training FLOPs counted on the real network), ``distill``
(self-distillation through time: the teacher's two steps as the student's target)."""
