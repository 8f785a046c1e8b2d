"""Decoding many requests: the step loop over a batch (`step`) and the continuous-batching `Engine`
(`scheduler`)."""
