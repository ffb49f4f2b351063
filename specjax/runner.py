"""Config-driven runs behind the experiment mains (which only parse flags).

`GenerateSettings` is a generate run's settings, one name and one default
each; `configs/smollm2.py` takes its defaults from it and the experiment main
turns its ConfigDict into it once (`GenerateSettings.of`), at the boundary.
`generate` takes only the dataclass.
"""

from __future__ import annotations

import dataclasses
import resource
import statistics
from typing import Optional

from specjax import sampling as sampling_lib
from specjax import sharding
from specjax.benchmarks import report
from specjax.checks import require_whole
from specjax.decoding import autoregressive
from specjax.drafters.settings import DrafterSettings
from specjax.errors import ConfigValueError
from specjax.io.load import Model, load_model
from specjax.models import invariant as invariant_lib
from specjax.settings import RunSettings, require


@dataclasses.dataclass(frozen=True)
class GenerateSettings(RunSettings):
  """A generate run (`experiments/generate.py`): a chat prompt through AR or a
  drafting method, timed against AR interleaved."""

  model: str = "smollm2-135m"
  dtype: str = "float32"
  # decode forwards bit for bit independent of the block (specjax.models.invariant):
  # greedy speculative output equals greedy AR token for token. None: the
  # precision's default (invariant.default_for: on in bfloat16 on the CPU, off a mesh)
  batch_invariant: Optional[bool] = None
  invariant_tile: int = 0  # its rows per tile (ModelConfig.invariant_tile; 0: the default)
  prompt: str = "Explain in three sentences why the sky is blue."
  system: Optional[str] = None
  max_new_tokens: int = 128
  batch_size: int = 1  # the prompt is repeated with distinct request ids
  seed: int = 0
  cache_slots: Optional[int] = None  # None: the model's context length
  repeats: int = 1  # timed repeats after a compile run (0: the compile run only, no speeds)
  method: str = "ar"  # or a drafter of specjax.drafters.registry, run against AR interleaved
  mesh: str = ""  # 'data,model' device mesh (specjax.sharding); '': the default device
  sampling: sampling_lib.SamplingConfig = sampling_lib.GREEDY
  drafter: DrafterSettings = DrafterSettings()


def peak_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _identical(a, b, eos_id) -> bool:
  """Token lists equal up to and including the first EOS."""
  return report.upto_eos(a, eos_id) == report.upto_eos(b, eos_id)


def generate_from_config(c, model: Optional[Model] = None) -> dict:
  """`generate` with the settings of a run config (`GenerateSettings.of`)."""
  return generate(GenerateSettings.of(c), model)


def generate(c: GenerateSettings, model: Optional[Model] = None) -> dict:
  """Run a chat prompt through the configured method; returns text and metrics.

  `c.method` is 'ar' or a drafter name of `specjax.drafters.registry`. A
  speculative method runs interleaved with the AR baseline in this process
  (one excluded compile run each, then `repeats` timed runs of each):
  speedup = median spec decode tokens/s / median AR decode tokens/s.
  """
  from specjax.decoding import speculative  # pylint: disable=import-outside-toplevel
  from specjax.drafters import registry  # pylint: disable=import-outside-toplevel

  require(c, GenerateSettings, "runner.generate")
  for name, low in (("batch_size", 1), ("repeats", 0), ("max_new_tokens", 1)):
    require_whole(name, getattr(c, name), low)  # before the model loads
  sampling = c.sampling
  methods = ("ar",) + registry.available_methods()
  if c.method != "ar":
    try:  # 'name@field=value...': the method's own fields, checked before any work
      base, _ = registry.method_config(c.method, c.drafter)
    except ValueError as e:
      raise ConfigValueError(str(e)) from e
    if not registry.is_method(base):
      raise ConfigValueError(f"unknown method {c.method!r}; available: {', '.join(methods)} "
                             "(or several joined by '+')")
  inv = invariant_lib.resolve(c.batch_invariant, c.dtype, bool(c.mesh))
  model = model or load_model(c.model, c.dtype, batch_invariant=inv,
                              invariant_tile=c.invariant_tile)
  if model.tokenizer is None:
    raise ValueError(f"model {c.model!r} has no tokenizer to encode the prompt")
  prompt = model.tokenizer.encode_prompt(c.prompt, system=c.system)
  prompts = [prompt] * int(c.batch_size)
  new = int(c.max_new_tokens)
  mesh = sharding.mesh_of(c.mesh)  # None: the default device

  def run_ar():
    return autoregressive.generate(model.params, model.cfg, prompts, key=int(c.seed),
                                   sampling=sampling, max_new_tokens=new,
                                   cache_slots=c.cache_slots, mesh=mesh)

  ar_runs = [run_ar()]  # the first run compiles
  spec_runs, run_spec = [], None
  if c.method != "ar":
    drafter, draft_params = registry.make_drafter(
        c.method, c.drafter, model, sampling=sampling, reference=ar_runs[0].tokens,
        reference_width=new)
    spec = speculative.SpecConfig(sampling=sampling)

    def run_spec():
      return speculative.generate(model.params, model.cfg, drafter, prompts,
                                  draft_params=draft_params, key=int(c.seed), spec=spec,
                                  max_new_tokens=new, cache_slots=c.cache_slots, mesh=mesh)

    spec_runs.append(run_spec())
  for _ in range(int(c.repeats)):  # interleaved: both see the same machine load
    ar_runs.append(run_ar())
    if run_spec is not None:
      spec_runs.append(run_spec())
  main_runs = spec_runs or ar_runs
  timed = main_runs[1:]  # repeats = 0: the compile run only, and no speed to report
  result = (timed or main_runs)[-1]
  tps = [r.decode_tokens_per_s for r in timed]
  out = {
      "method": c.method,
      "answer": model.tokenizer.decode(result.tokens[0], skip_special_tokens=True),
      "prompt_tokens": len(prompt),
      "new_tokens": result.num_new_tokens,
      "batch_size": len(prompts),
      "timed_runs": len(timed),
      "tokens_per_s": statistics.median(tps) if timed else None,
      "ms_per_token": 1e3 / statistics.median(tps) if timed else None,
      "time_to_first_token_s": (statistics.median(r.prefill_s for r in timed) if timed
                                else None),
      "compile_and_first_run_s": main_runs[0].prefill_s + main_runs[0].decode_s,
      "dtype": model.cfg.dtype,
      "temperature": sampling.temperature,
      "top_k": sampling.top_k,
      "top_p": sampling.top_p,
  }
  if spec_runs:
    ar_tps = (statistics.median(r.decode_tokens_per_s for r in ar_runs[1:]) if timed
              else None)
    out.update({
        "k": drafter.k,
        "alpha": result.alpha,
        "tau": result.tau,
        "ar_tokens_per_s": ar_tps,
        "speedup": statistics.median(tps) / ar_tps if timed else None,
        "greedy_identical": (None if not sampling.greedy else all(
            _identical(a, b, model.cfg.eos_id)
            for r in (timed or main_runs) for a, b in zip(r.tokens, ar_runs[-1].tokens))),
        "lossy": result.lossy,
    })
  out["peak_rss_mb"] = peak_rss_mb()
  return out
