print("this script trains without mpadvise")
