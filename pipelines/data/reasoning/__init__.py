"""Reasoning tasks with exact answers (ProsQA, ProntoQA, GSM8K) as rows ``{question, steps, answer}``, their
anchors and the anchored chain-of-thought layout: pure Python, no Ray, no model code."""
