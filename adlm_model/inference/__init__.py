"""A trained model asked for text or scores: ``textgen`` (text in, text out: the generator behind the CLI and
the served model), ``infill`` (prompt / suffix infilling at the token level), ``limits`` (what one served request may
cost), ``likelihood`` (log-likelihood of a continuation: exact for AR, a Monte Carlo ELBO for the diffusion kinds)."""
