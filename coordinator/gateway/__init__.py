"""The Gateway API Inference Extension side of the coordinator: an endpoint picker (EPP) Envoy asks over ext_proc."""
