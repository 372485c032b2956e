"""Quality of the weight formats: ``kvscope eval ppl`` (perplexity on a shipped text and greedy agreement,
each format against float32 of the same model, through the engine's own forward). See
docs/engine-server.md."""
