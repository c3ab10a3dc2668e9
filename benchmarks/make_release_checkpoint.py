"""Write a random DeepSeek-V4 checkpoint in the release's format (FP8 dense linears with ue8m0 block scales, MXFP4
routed experts, bf16 compressor / indexer projections, the release's names and ``quantization_config``) for a
config, one shard per decoder layer, for the FP8 loading tests and benchmarks::

    python -m benchmarks.make_release_checkpoint --config benchmarks/configs/v4_flash_proxy.json --out /tmp/rel \\
        [--layers 4] [--experts 16] [--seed 0]

``--layers`` / ``--experts`` shrink the geometry (keeping everything else), so a full-width layer fits a benchmark.
Each unit is drawn and written on its own: the host holds one layer at a time (in fp32).
"""

from __future__ import annotations

import argparse
import json

from csattn.models.deepseek_v4 import DeepseekV4ModelConfig
from csattn.models.deepseek_v4.release import write_release_checkpoint


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="an HF config.json of the geometry")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers")
    p.add_argument("--experts", type=int, default=None, help="routed experts per layer")
    p.add_argument("--mtp", type=int, default=None, help="MTP blocks (default: the config's)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    with open(a.config) as f:
        raw = json.load(f)
    if a.layers is not None:
        for key in ("layer_types", "mlp_layer_types", "compress_ratios"):
            if isinstance(raw.get(key), list):
                raw[key] = raw[key][: a.layers]
        raw["num_hidden_layers"] = a.layers
    if a.experts is not None:
        raw["n_routed_experts"] = a.experts
    if a.mtp is not None:
        raw["num_nextn_predict_layers"] = a.mtp
    config = DeepseekV4ModelConfig.from_hf(raw)
    weight_map = write_release_checkpoint(config, a.out, seed=a.seed)
    print(json.dumps({"out": a.out, "tensors": len(weight_map), "shards": len(set(weight_map.values()))}))


if __name__ == "__main__":
    main()
