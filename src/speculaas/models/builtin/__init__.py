"""The shipped model: procedural scenes, a VQ tokenizer, an AR transformer and a judge."""
