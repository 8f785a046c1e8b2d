"""goose drafting inside other serving engines.

- `goose.integrations.vllm`: `GooseProposer`, vLLM's out-of-tree (``method="custom_class"``) proposer:
  GOOSE's spine as a chain per request, its length chosen from an online acceptance model and an online
  cost model of vLLM's verify step.
- `goose.integrations.sglang`: a plugin registering the speculative algorithm ``GOOSE`` in SGLang, whose
  worker drafts full spine + branch trees in SGLang's (tokens, ancestor mask) format.

Neither module imports its engine at import time; see docs/integrations.md.
"""
