"""The only places that know text: tokenizer loading (text), the tokenizer and detokenizer
processes (tokenize_worker, detokenize_worker) and incremental detokenization (incremental)."""
