from services.runner import SERVICES, main

if __name__ == "__main__":
    raise SystemExit(main(list(SERVICES)))
