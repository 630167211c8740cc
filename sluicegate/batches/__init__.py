"""What ingress's Files and Batches routes and the batch service both use: stored files (:mod:`.files`), input-line
checks (:mod:`.lines`), batch state in Redis (:mod:`.store`), and the Celery app both build: the batch service
runs its tasks, ingress sends ``advance`` through it (:mod:`.celery_app`).
"""
