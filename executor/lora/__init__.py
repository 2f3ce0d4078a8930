"""LoRA adapters in the executor: their weights, the layers that apply them, the manager.

weights.py   an adapter's A/B tensors (PEFT safetensors) as one A and one B per fused
             matmul of the model (qkv, o, gate/up, down), scaling folded into B
layers.py    LoRALinear: a model matmul plus, for each adapter in the step, its rows'
             low-rank update (a segmented matmul over the rows grouped by adapter)
manager.py   LoRAManager: wraps the model's matmuls, loads adapters as requests name
             them, and tells the layers which rows use which adapter each step
"""
