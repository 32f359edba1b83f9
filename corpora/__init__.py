"""qkit's pinned data: corpus manifests, the factual battery and the outliers prompt (installed as ``qkit.corpora``)."""
