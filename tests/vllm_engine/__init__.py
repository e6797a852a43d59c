"""vLLM engine harness: a real vLLM runs on pagekeeper (``make test-vllm``)."""
