"""What people look at: matplotlib charts (`plots`) and the ipywidgets explorer (`explorer`)."""
