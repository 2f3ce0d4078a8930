"""`zllm proxy`: prefill/decode disaggregation's router in front of two servers."""
