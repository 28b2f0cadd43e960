"""Activation datasets (API.md section 5, "Activation datasets"): `llm.extract` and
`vinterp.extract` stream the activations of many prompts to a Hugging Face `datasets`
directory, prefill only, with bounded memory; a run killed at any moment continues where it
stopped when run again with the same spec. A module per role:

- request: what is asked for (`ExtractionRequest`, one keyword signature), its checks, and
  the dataset it opens (`open_job`): columns, shard size, tokens queued in the engine
- spec: what decides the rows (`extraction_spec`): the engine's facts, the checkpoint's
  identity, and what the manifest says beside it
- prompts: where prompts come from (`prompt_source`) and their token ids
- packing: a corpus cut into windows of tokens as SAELens cuts them (`Packed`)
- plan: the positions kept and how prompts are cut into shards
- sae: an SAE's sites, stored as their top k features per token
- stream: shards through one engine's stream of requests onto the disk writers
- progress: the progress bar and the closing line
- local: `llm.extract` on an engine in this process
- replicas: data-parallel replicas as Ray actors, one dataset
- launch: `vinterp.extract`, one engine here or the replicas

Nothing is imported here: `vinterp.extract` is the function (extraction/launch.py)."""
