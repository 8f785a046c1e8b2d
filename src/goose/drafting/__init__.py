"""Drafting: what each request might say next, as a `DraftTree` (`tree`) rooted at the last committed token.
The sources are the context n-gram index (`ngram`, the spine), the adjacency table of the model's own
top-k successors (`adjacency`, the branches), Lookahead's n-gram pool and Jacobi window (`lookahead`) and
REST's datastore (`datastore`); the builders turn them into trees: the GOOSE spine tree (`spine`) and the
comparison methods' chains, templates, isotropic trees and tries (`baselines`). Returns DraftTree builders
and their drafting state; nothing here calls the model.
"""
