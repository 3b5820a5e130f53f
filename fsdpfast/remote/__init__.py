"""Object stores (s3://, gs://, az://) as merge sources and outputs, through obstore (the `s3` extra)."""
