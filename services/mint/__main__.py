from services.runner import main

if __name__ == "__main__":
    raise SystemExit(main(["mint"]))
