"""goose inside other engines: transformers' `model.generate`, vLLM and SGLang.

- `goose.integrations.hf`: ``model.generate(custom_generate=...)``: goose's step loop under transformers'
  own argument handling, as a callable (`custom_generate`) and as a local repository (`HUB_ENTRY`, the
  `goose.hub` folder).
- `goose.integrations.vllm`: `GooseProposer`, vLLM's out-of-tree (``method="custom_class"``) proposer:
  GOOSE's spine as a chain per request, its length chosen from an online acceptance model and an online
  cost model of vLLM's verify step.
- `goose.integrations.sglang`: a plugin registering the speculative algorithm ``GOOSE`` in SGLang, whose
  worker drafts full spine + branch trees in SGLang's (tokens, ancestor mask) format.

Neither the vLLM nor the SGLang module imports its engine at import time; see docs/integrations.md.
"""
