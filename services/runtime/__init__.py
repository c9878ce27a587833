"""What every service shares: settings, the Spark session, the supervisor, checkpoints, logs, the JVM's and Python workers' start-up, driver state and metrics."""
