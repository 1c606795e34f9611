from .entry import windowgpt

if __name__ == "__main__":
    windowgpt()
