"""The ground-truth synthetic languages, exact likelihoods as oracles: ``language`` (the ``Testbed``: exact
log-probabilities, marginals, conditionals, entropy, floors; the anchored preset), ``natural`` (the natural-confidence
preset: a hidden word chain spelled in symbols)."""
