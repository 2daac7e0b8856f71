"""Reading and writing bytes where they live: local files written atomically, object storage and HTTP(S) through obstore, credentials, staged files. Knows nothing of datasets."""
