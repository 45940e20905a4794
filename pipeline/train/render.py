"""The picture of one iteration's graph (nothing runs): what ``rlhfless graph`` draws and
the report and trackers show."""

from __future__ import annotations

import dask
from dask.core import get_dependencies
from dask.utils import key_split

from rlhfless.ops.data.schema import PROMPTS
from rlhfless.ops.engine.engine_types import WeightsRef

from ..cluster.pools import fit_overlap
from ..durable.runs import RunDir
from ..specs import make_specs
from ..task_keys import STAGE_COLOURS, parse_key, stage_of
from .graph import iteration_graph


def render_graph(cfg, filename: str) -> str:
    """Write the graph of one iteration (nothing runs) to ``filename`` through graphviz."""

    cfg, _ = fit_overlap(cfg)  # the shards the run would make
    run = RunDir(cfg.run_dir)
    specs = make_specs(cfg, cfg.model, run)
    prompts = PROMPTS.empty_table()
    graph = iteration_graph(prompts, WeightsRef(0, cfg.model), 1, cfg.gen_workers, specs.gen,
                            specs.reward, specs.train, algorithm=cfg.algorithm, seed=cfg.seed,
                            min_prefix=cfg.min_prefix)
    outputs = graph.outputs()
    keys = dict(dask.base.collections_to_expr(outputs).__dask_graph__())
    attrs = {
        k: {"style": "filled", "fillcolor": STAGE_COLOURS[stage_of(k)], "label": str(k)}
        if stage_of(k) in STAGE_COLOURS else {"label": "", "shape": "point"}
        for k in keys
    }
    shards = {dep: {"label": f"shard {parse_key(k).shard}"}  # the input of generate-1-i
              for k in keys if stage_of(k) == "generate"
              for dep in get_dependencies(keys, k) if key_split(dep) == "getitem"}
    dask.visualize(*outputs, filename=filename, optimize_graph=False, rankdir="LR",
                   function_attributes=attrs, data_attributes=shards)
    return filename
