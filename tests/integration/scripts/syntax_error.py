import advisor

def broken(:
    pass
