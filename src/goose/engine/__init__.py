"""Engine: decoding requests. Each method pairs drafting state with a tree builder (`methods`); the step loop
over a batch (`step`) drafts, selects, runs one forward, walks each tree (`verify`), chooses each token by
argmax or an exact sample (`sampling`) and records per-request statistics (`stats`); the continuous-batching
`Engine` (`scheduler`) runs that loop on a background thread. Returns tokens per request.
"""
