"""Selection: which nodes of each request's draft tree are verified this step. An online acceptance model
gives each node's probability of being accepted (`acceptance`), a measured cost curve gives the milliseconds
of a forward per query size (`costmodel`), and the selector keeps the subtree, or for a batch the set of
subtrees, with the most expected tokens per millisecond (`selector`). Returns which nodes each request
verifies.
"""
