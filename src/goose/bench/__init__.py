"""`goose bench`: a Spec-Bench-compatible benchmark harness (datasets, runner, summary, report, plots)."""
