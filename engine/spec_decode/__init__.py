"""N-gram prompt-lookup speculative decoding: the proposer (:mod:`.ngram`), the verification rule
(:mod:`.rejection_sampler`), the per-request / per-batch adaptivity (:mod:`.adaptive`) and the step's
counters (:mod:`.stats`). See docs/architecture.md "Speculative decoding"."""
