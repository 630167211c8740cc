"""GPU workers: the inference engine (`gpu_workers.engine`) and the Kafka-to-engine-to-Redis worker."""
