"""The development stack: the embedded broker and S3 server, and fault injection. Nothing in
production imports it."""
