"""The keys of vLLM's `additional_config` through which a vinterp engine tells its workers
what to install (read by the plugin and the worker extension, written by the engines)."""

CONFIG_KEY = "vinterp_sites"  # present only in vinterp engines; the sites' layout version
SITE_PATHS_KEY = "vinterp_site_paths"  # the user's `sites=` module paths
CAPTURE_IN_GRAPH_KEY = "vinterp_capture_in_graph"  # capture buffers in the compiled model
CHECK_APPLIED_KEY = "vinterp_check_applied"  # counters of what the site ops applied
CAPTURE_ROWS_KEY = "vinterp_capture_rows"  # rows of each capture buffer (None: max_num_seqs)
SAE_CLAMP_HOSTS_KEY = "vinterp_sae_clamp_hosts"  # sites whose SAE feature steering is compiled
SAE_CLAMP_KEY = "vinterp_sae_clamp_features"  # SAE features per host in the steering tables
NUM_LAYERS_KEY = "vinterp_num_layers"  # the engine builds and loads only the first N layers
