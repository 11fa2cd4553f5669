"""Model families, weight loading (HF safetensors dirs, GGUF files), tokenizer and chat template.

``model.Model`` is the entry point; ``checkpoint`` resolves what the user named to an HF-style directory
(``gguf_cache`` turns a GGUF file into one, via ``gguf_reader`` and ``gguf_tokenizer``); ``hf_loader`` reads
config and weights, ``native_weights`` keeps quantised and 16-bit weights as stored (``weights="native"``),
``weights`` assigns them to a family runtime (``llama``; ``lfm2``, whose convolution layers keep fixed
state; ``gemma``, Gemma 2 and 3 text; ``bamba``, whose Mamba-2 layers keep a fixed conv window and a fixed
recurrent state); ``tokenizer`` and ``chat_template`` handle text. ``base`` is the contract every runtime
meets; ``synthetic`` the test model.
"""
